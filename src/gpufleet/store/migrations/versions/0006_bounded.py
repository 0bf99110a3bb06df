"""Row numbers that do not run out, and late results in the history.

``job_logs.seq`` and ``audit.seq`` become 64-bit on PostgreSQL (their sequences too: a
serial's sequence stops at 2^31 - 1 whatever the column's type). SQLite's INTEGER PRIMARY
KEY is 64-bit already. ``attempts.late_result`` keeps a result a worker sent after its
attempt had ended, which the server refused.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_SEQUENCES = (("job_logs", "seq"), ("audit", "seq"))


def upgrade() -> None:
    op.add_column("attempts", sa.Column("late_result", sa.Text))
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in _SEQUENCES:
        op.alter_column(table, column, type_=sa.BigInteger, existing_type=sa.Integer)
        op.execute(f"ALTER SEQUENCE {table}_{column}_seq AS bigint")


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("late_result")
