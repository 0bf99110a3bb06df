"""``gpufleet envs``: the Python environments the workers have built for jobs, and
building one ahead of time (docs/environments.md).

Building ahead is a job like any other: aimed at each worker named, in a CPU slot, it
runs ``python -c ...`` in the environment, so the worker builds it (or finds it built)
exactly as for a real job, and the build's lines and time are in that job's log.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import CaOpt, JsonOpt, ServerOpt, age, client, err, out, print_json, shown
from gpufleet.cli.environments import environment_model
from gpufleet.cli.jobs import follow
from gpufleet.client import Client
from gpufleet.domain.environments import EnvRequest
from gpufleet.domain.quota import size_text
from gpufleet.errors import ConfigError
from gpufleet.wire import EnvironmentModel, JobSpecModel, RequirementsModel, WorkerOut

envs_app = typer.Typer(
    help="The Python environments workers have built for jobs: list them, or build one "
    "ahead of time on a worker.",
    no_args_is_help=True,
)
_Opt = typer.Option
#: What an environment built ahead of time runs: it says where its Python is.
PROBE = "import sys; print('environment ready:', sys.executable)"


def register(app: typer.Typer) -> None:
    envs_app.command("list")(list_envs)
    envs_app.command("build")(build)
    app.add_typer(envs_app, name="envs")


def list_envs(
    worker: Annotated[str | None, _Opt(help="Only this worker's (id or name).")] = None,
    pool: Annotated[str | None, _Opt(help="Only this pool's workers.")] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the environments each worker has built: its key, Python, size, when a job
    last used it, and what it is built from, most recently used first."""
    with client(server, ca) as c:
        rows = [w for w in c.workers(pool) if worker in (None, w.id, w.name)]
    if as_json:
        print_json([{"worker": w.name, "environments": w.environments} for w in rows])
        return
    if not any(w.environments for w in rows):
        err.print("no environments built" + (f" on {shown(worker)}" if worker else ""))
        return
    out.print(env_table(rows))


def env_table(rows: list[WorkerOut]) -> Table:
    table = Table(box=None, header_style="bold")
    for col in ("WORKER", "ENVIRONMENT", "PYTHON", "SIZE", "LAST USED", "BUILT FROM"):
        table.add_column(col)
    for w in rows:
        for e in w.environments:
            table.add_row(
                shown(w.name),
                shown(e.key[:12]),
                shown(e.python),
                size_text(e.size_bytes),
                f"{age(datetime.fromtimestamp(e.last_used, UTC))} ago",
                shown(e.describe),
            )
    return table


def build(
    worker: Annotated[
        list[str] | None,
        _Opt(help="A worker to build it on (id or name; repeatable)."),
    ] = None,
    pool: Annotated[
        str | None, _Opt(help="Build it on every worker of this pool that is not offline.")
    ] = None,
    with_requirements: Annotated[
        Path | None,
        _Opt(
            "--with-requirements",
            help="A requirements.txt, or a pyproject.toml (with its uv.lock), as for submit.",
        ),
    ] = None,
    with_: Annotated[
        list[str] | None, _Opt("--with", metavar="REQ", help="A requirement (repeatable).")
    ] = None,
    python: Annotated[str | None, _Opt(help="The Python version (3.12 or 3.12.4).")] = None,
    upgrade: Annotated[
        bool, _Opt("--upgrade", help="Resolve afresh, replacing the fleet's lock.")
    ] = False,
    wait: Annotated[bool, _Opt("--wait", help="Follow each build to its end.")] = False,
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Build an environment ahead of time on workers (operators), so the first job that
    needs it starts at once: one job per worker, aimed at it, in a CPU slot, which runs
    `python` in the environment. Prints the job ids."""
    req = _request(with_requirements, with_, python, upgrade)
    if not worker and pool is None:
        raise ConfigError("name the workers: --worker NAME (repeatable) or --pool POOL")
    with client(server, ca) as c:
        targets = _targets(c.workers(pool), worker, pool)
        ids = _submit_builds(c, targets, environment_model(c, req), as_json)
        if wait:
            _wait_built(c, ids, as_json)
    if as_json:
        print_json({"jobs": ids})
        return
    for job_id in ids:
        print(shown(job_id))


def _request(
    with_requirements: Path | None, with_: list[str] | None, python: str | None, upgrade: bool
) -> EnvRequest:
    """The environment the options name; refused when they name none."""
    req = EnvRequest(
        with_requirements=str(with_requirements) if with_requirements else None,
        with_=tuple(with_ or ()),
        python=python,
        upgrade=upgrade,
    )
    if req.empty:
        raise ConfigError("name the environment: --with-requirements FILE and/or --with REQ")
    return req


def _submit_builds(
    c: Client, targets: list[WorkerOut], env: EnvironmentModel, as_json: bool
) -> list[str]:
    """Submit one build job per worker, aimed at it; their ids, in order."""
    ids = []
    for w in targets:
        spec = JobSpecModel(
            name=f"build environment on {w.name}",
            command=["python", "-c", PROBE],
            requirements=RequirementsModel(worker=w.id, cpu_only=True),
            pool=w.pool,
            max_attempts=1,
            environment=env,
            tags=["environment"],
            outputs=[],
        )
        result = c.submit(spec, queue=True)
        ids.append(result.job.id)
        if not as_json:
            err.print(f"{shown(w.name)}: job {shown(result.job.id)}")
    return ids


def _wait_built(c: Client, ids: list[str], as_json: bool) -> None:
    """Follow each build to its end; exit 1 naming those that did not succeed."""
    statuses = [follow(c, job_id, as_json) for job_id in ids]
    failed = [i for i, s in zip(ids, statuses, strict=True) if s != "succeeded"]
    if failed:
        err.print(f"not built: {shown(', '.join(failed))} (gpufleet show JOB says why)")
        raise typer.Exit(1)


def _targets(rows: list[WorkerOut], named: list[str] | None, pool: str | None) -> list[WorkerOut]:
    """The workers to build on: those named (each must exist), else the pool's online."""
    if named:
        found = []
        for ref in named:
            match = [w for w in rows if ref in (w.id, w.name)]
            if not match:
                raise ConfigError(
                    f"--worker {ref}: no such worker" + (f" in {pool}" if pool else "")
                )
            found.append(match[0])
        return found
    online = [w for w in rows if w.status != "offline"]
    if not online:
        raise ConfigError(f"--pool {pool}: no worker of it is online")
    return online
