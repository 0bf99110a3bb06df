"""Alembic environment: runs on the connection gpufleet hands it (see store/migrate.py)."""

from alembic import context

from gpufleet.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
