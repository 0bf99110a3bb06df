"""An upload session's owner (``uploads.token_id``: only the token that opened it may
append to it, finish or abort it), and ``fleet_keys``: random keys the servers of a fleet
share, such as the one each attempt's lease secret is derived with.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.add_column(sa.Column("token_id", sa.String(64)))
    op.create_table(
        "fleet_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fleet_keys")
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("token_id")
