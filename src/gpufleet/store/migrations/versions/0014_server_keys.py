"""The fleet's own secrets: ``server_keys`` holds each by name, made by the first server
that needs it, so every server sharing the database uses the same (the key that makes a
pool-scoped caller's event ids opaque, server/event_ids.py; the key of each attempt's
lease secret, server/lease_secrets.py).

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "server_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("secret", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("server_keys")
