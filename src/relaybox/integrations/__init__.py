"""Framework integrations: SQLAlchemy ORM domain events, Django."""
