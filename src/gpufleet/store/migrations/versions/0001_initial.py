"""Initial schema: jobs, attempts, workers, hosts, job logs, tokens.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _jobs()
    _fleet()


def _jobs() -> None:
    """The queue: jobs, their indexes, and their attempts."""
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("pool", sa.String(200), nullable=False),
        sa.Column("manifest", sa.String(200)),
        sa.Column("model", sa.String(200)),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("lease", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(64)),
        sa.Column("gpus", sa.Text, nullable=False),
        sa.Column("lease_expires_at", sa.Float),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("claimed_at", sa.Float),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("not_before", sa.Float),
        sa.Column("exit_code", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("unrunnable", sa.Text),
    )
    op.create_index(
        "ix_jobs_queue",
        "jobs",
        ["status", "pool", sa.text("priority DESC"), "created_at", "id"],
    )
    op.create_index("ix_jobs_worker", "jobs", ["worker_id", "status"])
    op.create_table(
        "attempts",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("worker_id", sa.String(64)),
        sa.Column("worker_name", sa.String(200)),
        sa.Column("gpus", sa.Text, nullable=False),
        sa.Column("claimed_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("exit_code", sa.Integer),
        sa.Column("outcome", sa.String(32)),
        sa.Column("error", sa.Text),
    )


def _fleet() -> None:
    """Workers, host policies, job output and tokens (created in this order, as before)."""
    op.create_table(
        "workers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("pool", sa.String(200), nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("capability", sa.Text, nullable=False),
        sa.Column("cpu_slots", sa.Integer, nullable=False),
        sa.Column("ephemeral", sa.Boolean, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("drain", sa.Boolean, nullable=False),
        sa.Column("gpu_stats", sa.Text, nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("last_heartbeat", sa.Float),
    )
    op.create_table(
        "hosts",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("manifest", sa.String(200), nullable=False),
        sa.Column("policy", sa.Text, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "job_logs",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("stream", sa.String(8), nullable=False),
        sa.Column("line", sa.Text, nullable=False),
        sa.Column("ts", sa.Float, nullable=False),
    )
    op.create_index("ix_job_logs_job", "job_logs", ["job_id", "seq"])
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("pool", sa.String(200)),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
    )


def downgrade() -> None:
    for table in ("tokens", "job_logs", "hosts", "workers", "attempts", "jobs"):
        op.drop_table(table)
