"""The data plane: blobs, resumable uploads, artifacts, job dependencies.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("waiting", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("archive", sa.Text),
    )
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "artifacts",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("files", sa.Text, nullable=False),
        sa.Column("file_count", sa.Integer, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "job_deps",
        sa.Column("job_id", sa.String(64), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("dep_id", sa.String(64), primary_key=True),
    )
    op.create_index("ix_job_deps_dep", "job_deps", ["dep_id"])


def downgrade() -> None:
    op.drop_index("ix_job_deps_dep", "job_deps")
    for table in ("job_deps", "artifacts", "uploads", "blobs"):
        op.drop_table(table)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waiting")
