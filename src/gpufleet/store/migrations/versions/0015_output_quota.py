"""Output quotas: each attempt counts the bytes of output stored (``output_bytes``) and
dropped (``output_dropped``) and whether its output is being cut now (``output_cut``), so
every server sharing the database meters it the same way (gpufleet.domain.quota).

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for column in (
        sa.Column("output_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_dropped", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_cut", sa.Boolean, nullable=False, server_default=sa.false()),
    ):
        op.add_column("attempts", column)


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("output_cut")
        batch.drop_column("output_dropped")
        batch.drop_column("output_bytes")
