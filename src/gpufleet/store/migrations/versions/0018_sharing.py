"""Sharing (issue 35): a job keeps its owner (the submitting token's name, ``owner``) and
the queue is indexed by pool and owner for fair share (``ix_jobs_owner_queue``); ``usage``
holds each user's charged unit-seconds by pool and time slice.

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("owner", sa.String(200), nullable=False, server_default=""))
    # Jobs submitted before this revision belong to their token's name.
    op.execute(
        "UPDATE jobs SET owner = COALESCE((SELECT name FROM tokens "
        "WHERE tokens.id = jobs.submitted_by), '')"
    )
    pending = sa.text("status = 'pending'")
    op.create_index(
        "ix_jobs_owner_queue",
        "jobs",
        ["pool", "owner", sa.text("priority DESC"), "created_at", "id"],
        sqlite_where=pending,
        postgresql_where=pending,
    )
    op.create_table(
        "usage",
        sa.Column("owner", sa.String(200), primary_key=True),
        sa.Column("pool", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("start", sa.Float, primary_key=True),
        sa.Column("width", sa.Float, nullable=False),
        sa.Column("seconds", sa.Float, nullable=False),
    )
    op.create_index("ix_usage_start", "usage", ["start"])


def downgrade() -> None:
    op.drop_index("ix_usage_start", "usage")
    op.drop_table("usage")
    op.drop_index("ix_jobs_owner_queue", "jobs")
    # Plain DROP COLUMN: a batch copy of ``jobs`` would drop the triggers that count its
    # rows (0011).
    op.execute("ALTER TABLE jobs DROP COLUMN owner")
