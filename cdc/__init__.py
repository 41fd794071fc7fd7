"""cdc: change-data-capture for PostgreSQL (see ../shared/DESIGN.md)."""

__version__ = "0.1.0"
