"""The workstation's owner comes first (issue 35): a worker keeps its owner policy as
its last heartbeat said it (``owner_state``, JSON: why it takes no new jobs, the foreign
processes on its GPUs, the owner's GPUs); an attempt vacated for the owner has the cause
"owner" (``attempts.cause`` holds it already).

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("owner_state", sa.Text))


def downgrade() -> None:
    op.execute("ALTER TABLE workers DROP COLUMN owner_state")
