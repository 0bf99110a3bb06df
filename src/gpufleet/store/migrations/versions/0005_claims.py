"""Claims decided outside the write: each worker counts the claims made for it, so a claim
ranked on a snapshot of the worker's slots commits only if no other claim came between.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    column = sa.Column("claims", sa.BigInteger, nullable=False, server_default="0")
    op.add_column("workers", column)


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("claims")
