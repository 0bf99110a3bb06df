"""Access: token expiry and hint, workers bound to the token that enrolled them, audit log,
which pools may read each blob.

Revision ID: 0003
Revises: 0002
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.Float))
        batch.add_column(sa.Column("hint", sa.String(16), nullable=False, server_default=""))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("token_id", sa.String(64)))
    op.create_table(
        "audit",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("token_id", sa.String(64)),
        sa.Column("token_name", sa.String(200)),
        sa.Column("role", sa.String(16)),
        sa.Column("address", sa.String(64), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.String(2000), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("target", sa.String(200)),
    )
    op.create_index("ix_audit_at", "audit", ["at"])
    op.create_table(
        "blob_pools",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("pool", sa.String(200), primary_key=True),
    )
    _backfill()


def _backfill() -> None:
    """Tokens made before pools scope to ``default`` (a submitter or worker token without
    pools would otherwise see every pool); existing artifacts and package inputs become
    readable by their job's pool."""
    bind = op.get_bind()
    bind.execute(
        sa.text(
            "UPDATE tokens SET pool = 'default' "
            "WHERE role IN ('submitter', 'worker') AND (pool IS NULL OR pool = '')"
        )
    )
    grants: set[tuple[str, str]] = set()
    for sha, pool in bind.execute(
        sa.text("SELECT a.sha256, j.pool FROM artifacts a JOIN jobs j ON j.id = a.job_id")
    ):
        grants.add((sha, pool))
    for pool, spec in bind.execute(sa.text("SELECT pool, spec FROM jobs")):
        for item in json.loads(spec).get("inputs") or []:
            if item.get("kind") == "blob":
                grants.add((item["ref"], pool))
    if grants:
        table = sa.table("blob_pools", sa.column("sha256"), sa.column("pool"))
        bind.execute(table.insert(), [{"sha256": s, "pool": p} for s, p in sorted(grants)])


def downgrade() -> None:
    op.drop_table("blob_pools")
    op.drop_index("ix_audit_at", "audit")
    op.drop_table("audit")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("token_id")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("hint")
        batch.drop_column("expires_at")
