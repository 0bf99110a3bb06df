"""Upload sessions named at their end: ``uploads.sha256`` may be NULL, for a session the
client opened without the blob's hash (it hashes while it sends; the server names the blob
by the hash of what it received).

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.alter_column("sha256", existing_type=sa.String(64), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM uploads WHERE sha256 IS NULL")
    with op.batch_alter_table("uploads") as batch:
        batch.alter_column("sha256", existing_type=sa.String(64), nullable=False)
