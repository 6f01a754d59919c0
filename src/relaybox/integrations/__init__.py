"""Framework integrations: SQLAlchemy ORM domain events, Django, Alembic migrations, a
relay inside an ASGI (FastAPI, Starlette) or Flask application."""
