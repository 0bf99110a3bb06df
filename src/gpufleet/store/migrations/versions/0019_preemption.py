"""Preemption (issue 35): a running job asked to make way for a waiting one keeps when it
was asked (``preempt_requested_at``, cleared once its worker has handed it back), when it
was last preempted (``preempted_at``, for its protection) and by which job
(``preempted_by``).

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("preempt_requested_at", sa.Float))
    op.add_column("jobs", sa.Column("preempted_at", sa.Float))
    op.add_column("jobs", sa.Column("preempted_by", sa.String(64)))
    op.add_column("jobs", sa.Column("made_way_on", sa.String(64)))
    op.add_column("jobs", sa.Column("made_way_until", sa.Float))
    # The pending jobs a worker's slot is being freed for: a claim of that worker reads them.
    op.create_index(
        "ix_jobs_made_way",
        "jobs",
        ["made_way_on"],
        sqlite_where=sa.text("status = 'pending' AND made_way_on IS NOT NULL"),
        postgresql_where=sa.text("status = 'pending' AND made_way_on IS NOT NULL"),
    )
    # A job's detail names the jobs it preempted; few jobs ever preempt one.
    preempted = sa.text("preempted_by IS NOT NULL")
    op.create_index(
        "ix_jobs_preempted_by",
        "jobs",
        ["preempted_by"],
        sqlite_where=preempted,
        postgresql_where=preempted,
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_made_way", "jobs")
    op.drop_index("ix_jobs_preempted_by", "jobs")
    # Plain DROP COLUMN: a batch copy of ``jobs`` would drop the triggers that count its
    # rows (0011).
    for column in (
        "made_way_until",
        "made_way_on",
        "preempted_by",
        "preempted_at",
        "preempt_requested_at",
    ):
        op.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
