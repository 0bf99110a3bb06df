"""The dashboard's jobs page with 10,000 jobs in the database: how long its first API call
takes (``GET /v1/jobs?order=newest&limit=50``, with the total count), and how long Debian's
Chromium takes from opening the page to a usable table of the newest 50 jobs.

    .venv/bin/python bench/jobs_page.py [--jobs 10000] [--db sqlite|postgresql://...]

The browser part needs Debian's chromium (``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from _fleet import drop_pg_schema, fleet, fresh_pg_schema, percentile

CALLS = 100  # timed calls of each kind
LOADS = 10  # timed page loads


async def fill(url: str, token: str, jobs: int) -> None:
    """Submit ``jobs`` jobs, 16 at a time (nothing runs them: no worker)."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        queue = iter(range(jobs))

        async def submitter() -> None:
            for i in queue:
                body = {"name": f"sweep-{i:05d}", "command": ["python", "train.py"]}
                r = await client.post("/v1/jobs", json=body)
                r.raise_for_status()

        await asyncio.gather(*(submitter() for _ in range(16)))


def timed_calls(url: str, token: str, path: str) -> list[float]:
    out = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
        client.get(path).raise_for_status()  # warm
        for _ in range(CALLS):
            start = time.perf_counter()
            r = client.get(path)
            out.append((time.perf_counter() - start) * 1000)
            r.raise_for_status()
            assert len(r.json()) == 50 and int(r.headers["x-total-count"]) > 0
    return out


def page_loads(url: str, token: str) -> list[float] | None:
    chromium = shutil.which("chromium")
    if chromium is None:
        print("no chromium (apt-get install chromium): page load not measured")
        return None
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            context = browser.new_context()
            page = context.new_page()
            page.goto(url + "/")
            page.fill("#token", token)
            page.click("button[type=submit]")
            page.wait_for_selector("#nav:not([hidden])")
            for _ in range(LOADS + 1):
                page.goto("about:blank")
                start = time.perf_counter()
                page.goto(url + "/#/jobs")
                page.wait_for_selector("[data-count='50'] tbody tr >> nth=49")
                out.append((time.perf_counter() - start) * 1000)
        finally:
            browser.close()
    return out[1:]  # the first load fills the browser's cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--db", default="sqlite", help="sqlite, or a postgresql:// URL")
    args = parser.parse_args()
    pg = args.db.startswith("postgres")
    db = fresh_pg_schema(args.db) if pg else None
    try:
        with fleet() as f:
            url = f.start_server(db)
            token = f.token()
            assert token
            began = time.monotonic()
            asyncio.run(fill(url, token, args.jobs))
            print(f"submitted {args.jobs} jobs in {time.monotonic() - began:.1f} s")
            for label, path in (
                ("first page", "/v1/jobs?order=newest&limit=50"),
                ("name filter", "/v1/jobs?order=newest&limit=50&name=sweep-0"),
                ("pending only", "/v1/jobs?order=newest&limit=50&status=pending"),
            ):
                ms = timed_calls(url, token, path)
                print(
                    f"{label:>13}: p50 {statistics.median(ms):.1f} ms, "
                    f"p95 {percentile(ms, 95):.1f} ms, max {max(ms):.1f} ms ({CALLS} calls)"
                )
            loads = page_loads(url, token)
            if loads:
                print(
                    f"  page usable: p50 {statistics.median(loads):.0f} ms, "
                    f"max {max(loads):.0f} ms ({LOADS} loads; goal < 1000 ms)"
                )
    finally:
        if db:
            drop_pg_schema(db)
    print("backend:", "postgresql" if pg else "sqlite")


if __name__ == "__main__":
    main()
