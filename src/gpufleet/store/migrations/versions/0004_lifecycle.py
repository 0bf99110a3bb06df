"""Worker lifecycle and who owns what: who submitted a job, the worker a job is aimed at,
the end of a failed attempt's stderr, a stop asked of a running job, when a worker went
offline, labels a worker token fixes, lifecycle events in the audit log, and one word for
an idle worker (available).

Revision ID: 0004
Revises: 0003
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN, not a batch: on SQLite a batch may rebuild the table, and the
    # rebuilt claim index (ix_jobs_queue) would lose its "priority DESC", making every
    # claim sort the whole queue.
    for column in (
        sa.Column("submitted_by", sa.String(64)),
        sa.Column("target", sa.String(200)),
        sa.Column("stderr_tail", sa.Text),
        sa.Column("stop_requested_at", sa.Float),
        sa.Column("stop_grace", sa.Float),
        sa.Column("stopped_early", sa.Boolean, nullable=False, server_default=sa.false()),
    ):
        op.add_column("jobs", column)
    # Partial: only jobs aimed at a worker are in it, so other claims do not pay for it.
    aimed = sa.text("target IS NOT NULL")
    op.create_index(
        "ix_jobs_target",
        "jobs",
        ["target", "status"],
        sqlite_where=aimed,
        postgresql_where=aimed,
    )
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("stderr_tail", sa.Text))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("offline_since", sa.Float))
        batch.add_column(sa.Column("fixed_labels", sa.Text, nullable=False, server_default="{}"))
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("labels", sa.Text, nullable=False, server_default="{}"))
    with op.batch_alter_table("audit") as batch:
        batch.add_column(sa.Column("event", sa.String(32)))
        batch.add_column(sa.Column("detail", sa.Text))
        batch.alter_column("method", existing_type=sa.String(8), nullable=True)
        batch.alter_column("path", existing_type=sa.String(2000), nullable=True)
        batch.alter_column("status", existing_type=sa.Integer, nullable=True)
    _backfill()


def _backfill() -> None:
    """``idle`` is ``available`` now; an offline worker has been gone since its last beat;
    a job aimed at a worker is found by that worker (pending now, or again later)."""
    bind = op.get_bind()
    bind.execute(sa.text("UPDATE workers SET status = 'available' WHERE status = 'idle'"))
    bind.execute(
        sa.text("UPDATE workers SET offline_since = last_heartbeat WHERE status = 'offline'")
    )
    rows = bind.execute(
        # (the colon is escaped: text() would take ":null" for a bound parameter)
        sa.text(r"""SELECT id, spec FROM jobs WHERE spec NOT LIKE '%"worker"\:null%'""")
    ).all()
    table = sa.table("jobs", sa.column("id"), sa.column("target"))
    for job_id, spec in rows:
        target = (json.loads(spec).get("requirements") or {}).get("worker")
        if target:
            bind.execute(table.update().where(table.c.id == job_id).values(target=target))


def downgrade() -> None:
    bind = op.get_bind()
    bind.execute(sa.text("UPDATE workers SET status = 'idle' WHERE status = 'available'"))
    bind.execute(sa.text("DELETE FROM audit WHERE event IS NOT NULL"))
    with op.batch_alter_table("audit") as batch:
        batch.alter_column("status", existing_type=sa.Integer, nullable=False)
        batch.alter_column("path", existing_type=sa.String(2000), nullable=False)
        batch.alter_column("method", existing_type=sa.String(8), nullable=False)
        batch.drop_column("detail")
        batch.drop_column("event")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("labels")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("fixed_labels")
        batch.drop_column("offline_since")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("stderr_tail")
    op.drop_index("ix_jobs_target", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stopped_early")
        batch.drop_column("stop_grace")
        batch.drop_column("stop_requested_at")
        batch.drop_column("stderr_tail")
        batch.drop_column("target")
        batch.drop_column("submitted_by")
    # A rebuilt table's claim index may have lost its order: make it again, as 0001 did.
    op.drop_index("ix_jobs_queue", "jobs")
    op.create_index(
        "ix_jobs_queue", "jobs", ["status", "pool", sa.text("priority DESC"), "created_at", "id"]
    )
