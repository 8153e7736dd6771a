"""Alembic migrations (shipped as a package so an installed service can migrate itself)."""
