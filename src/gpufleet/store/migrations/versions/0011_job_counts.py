"""Jobs counted by pool and status as they change, so ``status``, the jobs list's total
and ``/metrics`` cost the same whatever the number of jobs: ``job_counts``, kept by
triggers on ``jobs`` (on PostgreSQL through ``job_count_deltas``, folded in by the
server), filled from the jobs already there. And ``ix_jobs_created``: the jobs list's
pages, newest first, read in index order.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SQLITE_ADD = """
INSERT INTO job_counts (pool, status, n) VALUES (NEW.pool, NEW.status, 1)
ON CONFLICT (pool, status) DO UPDATE SET n = n + 1;
"""
SQLITE_TAKE = "UPDATE job_counts SET n = n - 1 WHERE pool = OLD.pool AND status = OLD.status;"
SQLITE = [
    f"CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs BEGIN {SQLITE_ADD} END",
    f"CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs BEGIN {SQLITE_TAKE} END",
    "CREATE TRIGGER job_counts_update AFTER UPDATE OF status, pool ON jobs "
    "WHEN OLD.status IS NOT NEW.status OR OLD.pool IS NOT NEW.pool "
    f"BEGIN {SQLITE_TAKE} {SQLITE_ADD} END",
]
POSTGRESQL = [
    """
CREATE FUNCTION gpufleet_job_count_delta() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO job_count_deltas (pool, status, n) VALUES (OLD.pool, OLD.status, -1);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO job_count_deltas (pool, status, n) VALUES (NEW.pool, NEW.status, 1);
    END IF;
    RETURN NULL;
END
$$
""",
    # The deltas go to the schema the migration ran in, whoever writes to jobs (an admin's
    # session with another search_path, a restore with an empty one).
    "ALTER FUNCTION gpufleet_job_count_delta() SET search_path FROM CURRENT",
    "CREATE TRIGGER job_counts_insert_delete AFTER INSERT OR DELETE ON jobs "
    "FOR EACH ROW EXECUTE FUNCTION gpufleet_job_count_delta()",
    "CREATE TRIGGER job_counts_update AFTER UPDATE OF status, pool ON jobs FOR EACH ROW "
    "WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.pool IS DISTINCT FROM NEW.pool) "
    "EXECUTE FUNCTION gpufleet_job_count_delta()",
]


def upgrade() -> None:
    op.create_index("ix_jobs_created", "jobs", ["created_at", "id"])
    op.create_table(
        "job_counts",
        sa.Column("pool", sa.String(200), primary_key=True),
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("n", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "job_count_deltas",
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("pool", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
    )
    # The triggers first: creating one locks ``jobs`` against writes until this
    # transaction ends, so the count below misses no change and none is counted twice.
    for statement in POSTGRESQL if op.get_context().dialect.name == "postgresql" else SQLITE:
        op.execute(statement)
    op.execute(
        "INSERT INTO job_counts (pool, status, n) "
        "SELECT pool, status, count(*) FROM jobs GROUP BY pool, status"
    )


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute("DROP TRIGGER job_counts_update ON jobs")
        op.execute("DROP TRIGGER job_counts_insert_delete ON jobs")
        op.execute("DROP FUNCTION gpufleet_job_count_delta()")
    else:
        for name in ("job_counts_insert", "job_counts_delete", "job_counts_update"):
            op.execute(f"DROP TRIGGER {name}")
    op.drop_table("job_count_deltas")
    op.drop_table("job_counts")
    op.drop_index("ix_jobs_created", table_name="jobs")
