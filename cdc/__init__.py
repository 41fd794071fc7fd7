"""cdc: change-data-capture for PostgreSQL (design: docs/architecture.md)."""

__version__ = "0.1.0"
