"""A page of log rows within a byte budget, summed by PostgreSQL: only the rows within it
are read whole."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Select, func, select


def fitted(page: Select[Any], budget: int, newest_first: bool) -> Select[Any]:
    """``page``'s rows whose lines before them, in its order, take under ``budget``
    bytes: the sizes are summed over the page's rows, which only then are read whole."""
    rows = page.subquery()
    size = func.octet_length(rows.c.line)
    order = rows.c.seq.desc() if newest_first else rows.c.seq
    ahead = (func.sum(size).over(order_by=order) - size).label("ahead")
    sized = select(rows, ahead).subquery()
    columns = [sized.c[col.name] for col in rows.c]
    return (
        select(*columns)
        .where(sized.c.ahead < budget)
        .order_by(sized.c.seq.desc() if newest_first else sized.c.seq)
    )


def summed_in_sql(
    conn: Connection, page: Select[Any], budget: int, newest_first: bool
) -> list[Any]:
    """PostgreSQL's :data:`~gpufleet.store.pages.Fitter`: the page :func:`fitted` to
    ``budget`` in the query, so the rows past it are never read whole."""
    return list(conn.execute(fitted(page, budget, newest_first)).all())
