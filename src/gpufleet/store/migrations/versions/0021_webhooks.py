"""Webhooks (issue 35): ``webhooks`` (who is told of which jobs' events, where, signed
with what), ``webhook_deliveries`` (due, made and given up; kept across a restart) and
``webhook_cursor`` (how far the scan of status changes has read).

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("secret", sa.String(200), nullable=False),
        sa.Column("events", sa.Text, nullable=False),
        sa.Column("running_past", sa.Float),
        sa.Column("created_by", sa.String(64)),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_webhooks_scope", "webhooks", ["scope", "target"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", SEQ, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(300), nullable=False, unique=True),
        sa.Column("webhook_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("state", sa.String(8), nullable=False),
        sa.Column("tries", sa.Integer, nullable=False),
        sa.Column("next_at", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("error", sa.String(300)),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["state", "next_at"])
    op.create_table(
        "webhook_cursor",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("webhook_cursor")
    op.drop_index("ix_webhook_deliveries_due", "webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhooks_scope", "webhooks")
    op.drop_table("webhooks")
