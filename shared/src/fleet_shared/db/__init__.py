"""Persistence: SQLAlchemy 2 models, the async engine, queries and the schema-head check."""
