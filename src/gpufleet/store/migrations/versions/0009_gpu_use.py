"""GPU memory per job: ``jobs.gpu_mib`` holds what the job's processes used on its GPUs
at its worker's last heartbeat (NVML's per-process accounting), in MiB.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("gpu_mib", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("gpu_mib")
