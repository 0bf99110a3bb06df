"""Placeholder on the webhooks branch only: another branch of issue 35 owns revision
0020. Delete this file when merging (0021_webhooks follows the real chain).

Revision ID: 0020
Revises: 0019
"""

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
