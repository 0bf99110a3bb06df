"""A page of a job's event log bounded in bytes as well as in records.

A job may write lines of up to a million characters, so a page of a thousand records
could hold a gigabyte. A page read with a ``budget`` stops at the first record that
takes its lines to ``budget`` bytes or more (it always holds one record, however long),
and the records past it are never read from the database: PostgreSQL sums the lines'
sizes in the query (``octet_length`` reads a long value's stored size, not the value)
and returns only the records that fit; SQLite (in process, each row read as it is
fetched) stops fetching. The order and the limit are applied once, in :func:`read_page`;
a backend differs only in the :data:`Fitter` it passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from sqlalchemy import Connection, Select

from gpufleet.store.rows_read import line_bytes

T = TypeVar("T")


def within(rows: Iterable[T], budget: int, size: Callable[[T], int]) -> Iterator[T]:
    """``rows`` up to the first one that takes their ``size`` to ``budget`` or more
    (it included); ``rows`` is read no further."""
    used = 0
    for row in rows:
        yield row
        used += size(row)
        if used >= budget:
            return


Fitter = Callable[[Connection, Select[Any], int, bool], list[Any]]
"""How a page is cut to its byte budget: ``(conn, page, budget, newest_first)``, with
``page`` already ordered and limited, gives the rows of ``page`` within ``budget``."""


def summed_as_read(
    conn: Connection, page: Select[Any], budget: int, newest_first: bool
) -> list[Any]:
    """The default :data:`Fitter`: the lines' sizes summed in Python as rows are fetched,
    and fetching stops at the budget (``newest_first`` is in the page's order already)."""
    with contextlib.closing(conn.execute(page)) as result:
        return list(within(result, budget, lambda r: line_bytes(r.line)))


def read_page(
    conn: Connection,
    q: Select[Any],
    limit: int,
    budget: int | None,
    newest_first: bool = False,
    *,
    fitter: Fitter = summed_as_read,
) -> list[Any]:
    """The rows of ``q`` (whose columns include ``seq`` and ``line``) in ``seq`` order
    (``newest_first``: descending), at most ``limit``, and with ``budget`` only those
    within it, as ``fitter`` cuts them (see the module)."""
    seq = q.selected_columns.seq
    page = q.order_by(seq.desc() if newest_first else seq).limit(limit)
    if budget is None:
        return list(conn.execute(page).all())
    return fitter(conn, page, budget, newest_first)
