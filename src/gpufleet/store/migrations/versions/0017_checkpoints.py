"""Checkpoints (issue 34): ``checkpoints`` keeps the snapshots of each job's checkpoint
folder; a job counts the attempts its machines lost apart from its own failures
(``losses``), keeps a pause asked of it (``pause_requested_at``) and why a requirement was
raised after an out-of-memory (``raised``); an attempt keeps the cause of its end
(``cause``) and the snapshot restored before it started (``restored``); a worker drained
with a deadline keeps it (``drain_by``).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", SEQ, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("files", sa.Text, nullable=False),
        sa.Column("file_count", sa.Integer, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("progress", sa.Text, nullable=False, server_default="{}"),
    )
    op.create_index("ix_checkpoints_job", "checkpoints", ["job_id", "id"])
    op.add_column("jobs", sa.Column("losses", sa.Integer, nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("pause_requested_at", sa.Float))
    op.add_column("jobs", sa.Column("raised", sa.Text))
    op.add_column("attempts", sa.Column("cause", sa.String(32)))
    op.add_column("attempts", sa.Column("restored", sa.Text))
    op.add_column("workers", sa.Column("drain_by", sa.Float))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35 and PostgreSQL): a batch copy of ``jobs`` would drop
    # the triggers that count its rows (0011).
    for table, column in (
        ("workers", "drain_by"),
        ("attempts", "restored"),
        ("attempts", "cause"),
        ("jobs", "raised"),
        ("jobs", "pause_requested_at"),
        ("jobs", "losses"),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    op.drop_index("ix_checkpoints_job", "checkpoints")
    op.drop_table("checkpoints")
