"""Output lines stored once: ``attempts.log_lines`` counts the lines an attempt's worker
has sent, so a batch sent again (its answer lost) names its first line and the lines
already stored are skipped.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "attempts",
        sa.Column("log_lines", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("log_lines")
