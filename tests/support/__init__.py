"""Test-only helpers: private Redis and PostgreSQL servers (never the shared ones on this host)."""
