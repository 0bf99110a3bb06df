"""Job environments (issue 32): ``environment_locks`` keeps each pool's lock of each
unlocked environment spec (the versions its first build in the pool resolved); an attempt keeps the
class of its failure (``failure``: "environment") and the environment it ran in
(``environment``), the job its latest attempt's failure class; a worker keeps the
environments in its cache (``environments``), for placement and ``workers``.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environment_locks",
        sa.Column("pool", sa.String(200), primary_key=True),
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("spec_key", sa.String(64), nullable=False),
        sa.Column("python", sa.String(32), nullable=False),
        sa.Column("torch_backend", sa.String(64)),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("worker_name", sa.String(200), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("replaced_at", sa.Float),
    )
    op.add_column("jobs", sa.Column("failure", sa.String(32)))
    op.add_column("attempts", sa.Column("failure", sa.String(32)))
    op.add_column("attempts", sa.Column("environment", sa.Text))
    op.add_column(
        "workers", sa.Column("environments", sa.Text, nullable=False, server_default="[]")
    )


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35 and PostgreSQL): a batch copy of ``jobs`` would drop
    # the triggers that count its rows (0011).
    for table, column in (
        ("workers", "environments"),
        ("attempts", "environment"),
        ("attempts", "failure"),
        ("jobs", "failure"),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    op.drop_table("environment_locks")
