#!/usr/bin/env bash
# Creates the capture role: LOGIN + REPLICATION, SELECT on the application's tables.
set -euo pipefail
psql -v ON_ERROR_STOP=1 -v pw="$CDC_PASSWORD" --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
CREATE ROLE cdc WITH LOGIN REPLICATION PASSWORD :'pw';
GRANT USAGE ON SCHEMA public TO cdc;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO cdc;
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO cdc;
SQL
