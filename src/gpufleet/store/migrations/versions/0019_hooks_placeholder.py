"""Placeholder on the webhooks branch only: another branch of issue 35 owns revision
0019. Delete this file when merging (0021_webhooks follows the real chain).

Revision ID: 0019
Revises: 0018
"""

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
