"""An upload session's owner (``uploads.token_id``): only the token that opened it may
read it, append to it, finish or abort it.

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


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("token_id")
