"""One event log per job: ``job_logs`` also holds ``state`` records (a status change: to
what, by whom, why) and ``progress`` records (JSON lines a job reports), numbered with
its output lines; ``jobs.progress`` and ``jobs.metrics`` keep the latest record and the
last value of each metric. The fleet-wide stream reads state records only, from a partial index.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

STATE = sa.text("stream = 'state'")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("progress", sa.Text))
    op.add_column("jobs", sa.Column("metrics", sa.Text))
    op.create_index(
        "ix_job_logs_state",
        "job_logs",
        ["seq"],
        sqlite_where=STATE,
        postgresql_where=STATE,
    )


def downgrade() -> None:
    op.drop_index("ix_job_logs_state", table_name="job_logs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("metrics")
        batch.drop_column("progress")
