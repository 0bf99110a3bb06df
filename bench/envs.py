"""Job environments (issue 32): what a worker's uv build costs against pip, and what a
warm environment adds to a job's dispatch.

    .venv/bin/python bench/envs.py [--quick] [--jobs 30] [--tmp DIR] [--skip-builds]

Prints, in one run, side by side:

1. a cold build of a CPU environment (numpy, scipy, scikit-learn, pandas, matplotlib,
   pinned; the Python of this venv) from the registry: gpufleet's ``EnvCache`` with an
   empty uv cache and an empty environment root (a worker's first build), against
   ``python -m venv`` and ``pip install --no-cache-dir -r requirements.txt`` (what ClearML
   Agent does on a fresh machine). Both read the same registry (https://pypi.org/simple,
   through whatever proxy this machine has; pip with no config file and no
   ``--find-links``, so neither reads a local copy), both resolve and download every
   wheel, both compile bytecode. gpufleet goes first, so a caching proxy would favour
   pip. Then the same again with warm caches (pip's cache primed by a pip install of the
   same requirements; uv's by gpufleet's cold build), each into a fresh environment;
2. a second environment sharing most of the first's packages (the same plus seaborn),
   built by the same ``EnvCache`` after the first (uv's cache warm);
3. dispatch, created to process started (the server's ``started_at - created_at``), of
   jobs whose environment is built and cached against jobs with none, taking turns, on a
   real local server and worker whose uv reads a folder of wheels (no network).

Each gpufleet build also prints uv's own timing of its steps (resolve, download, install,
bytecode), and a full run times ``pip --no-compile`` beside gpufleet's cold build less
uv's bytecode step: bytecode compilation is most of a build on two cores.

``--quick``: fewer dispatch jobs, no warm pip pair (its priming install is a second cold
pip install) and no ``--no-compile`` pip install. ``--skip-builds``: the dispatch part
alone (no network). ``--tmp``: where the environments, caches and venvs go (default: the
system's temporary folder); everything made there is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from _fleet import BenchFleet, percentile
from tests.wheels import make_wheel

from gpufleet.client import Client
from gpufleet.domain.environments import EnvFile, EnvSpec
from gpufleet.wire import EnvironmentModel, JobSpecModel
from gpufleet.worker.environments import EnvCache, EnvSettings
from gpufleet.worker.envphase import uv_binary
from gpufleet.worker.envtree import remove_tree

#: The realistic CPU environment: versions that have wheels for CPython 3.11 on Linux.
FIRST = (
    "numpy==2.4.6",
    "scipy==1.17.1",
    "scikit-learn==1.9.1",
    "pandas==3.1.1",
    "matplotlib==3.11.2",
)
#: The second shares all of the first's packages and adds one.
SECOND = (*FIRST, "seaborn==0.13.2")
REGISTRY = "https://pypi.org/simple"
BUILD_LIMIT = 900.0  # seconds: a build that takes longer is a broken network, not a figure


@dataclass
class Row:
    """One line of the table: the figure, what it is measured against, the goal."""

    figure: str
    value: str
    goal: str
    met: bool | None  # None: a figure with no goal of its own


# --------------------------------------------------------------------------- builds


def requirements_file(folder: Path, lines: Sequence[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "requirements.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@dataclass
class Build:
    """One build by gpufleet: its seconds, its packages, and uv's own timing of each step
    (from the lines it prints: resolve, download, install, bytecode)."""

    seconds: float
    packages: int
    steps: dict[str, float]

    def step(self, name: str) -> str:
        return f"{self.steps[name]:.1f} s" if name in self.steps else "not reported"

    def breakdown(self) -> str:
        known = sum(self.steps.values())
        parts = [f"{step} {secs:.1f}" for step, secs in self.steps.items()]
        return ", ".join([*parts, f"the rest {self.seconds - known:.1f} s"])


#: uv's summary lines, by the step each times.
STEPS = {
    "Resolved": "resolve",
    "Prepared": "download",
    "Installed": "install",
    "Bytecode compiled": "bytecode",
}
DURATION = re.compile(r" in (?:(\d+)m )?([\d.]+)(ms|s)$")


def uv_steps(lines: Sequence[str]) -> dict[str, float]:
    """uv's timing of each step, from its summary lines ("Prepared 18 packages in 4.9s")."""
    steps: dict[str, float] = {}
    for line in lines:
        found = DURATION.search(line.strip())
        step = next((name for head, name in STEPS.items() if line.startswith(head)), None)
        if found is None or step is None:
            continue
        minutes, value, unit = found.groups()
        secs = float(value) / (1000 if unit == "ms" else 1) + 60 * int(minutes or 0)
        steps[step] = steps.get(step, 0.0) + secs
    return steps


async def _gpufleet_build(root: Path, uv_cache: Path, req: Path) -> Build:
    """Build ``req`` as a worker does (plan, then ensure, no fleet lock: the first build
    of its spec)."""
    started = time.perf_counter()
    settings = EnvSettings(
        root=root,
        cap_bytes=100 << 30,
        uv=uv_binary(),
        build_timeout=BUILD_LIMIT,
        uv_env={"UV_CACHE_DIR": str(uv_cache)},
    )
    cache = EnvCache(settings, environ=_without("UV_"))
    data = req.read_bytes()
    spec = EnvSpec(requirements=EnvFile(req.name, hashlib.sha256(data).hexdigest(), len(data)))
    files = {req.name: data}
    plan = await cache.plan(spec, files, 0, None)
    lines: list[str] = []
    built = await cache.ensure(plan, files, None, lines.append)
    seconds = time.perf_counter() - started
    built.hold.release()
    if not built.built_here:
        raise SystemExit("the environment was not built (it was already in a fresh cache?)")
    return Build(seconds, len(built.versions), uv_steps(lines))


def gpufleet_build(root: Path, uv_cache: Path, req: Path) -> Build:
    return asyncio.run(_gpufleet_build(root, uv_cache, req))


def _without(prefix: str) -> dict[str, str]:
    """This process's environment less the variables that start with ``prefix``."""
    return {k: v for k, v in os.environ.items() if not k.startswith(prefix)}


def pip_env() -> dict[str, str]:
    """pip reads PyPI alone: no config file (this machine's names local wheel folders and
    a local index copy) and no ``PIP_FIND_LINKS``; its CA bundle (the proxy's) kept."""
    env = _without("PIP_")
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_CERT=os.environ.get("PIP_CERT", ""),
    )
    if not env["PIP_CERT"]:
        del env["PIP_CERT"]
    return env


def pip_build(venv: Path, req: Path, cache: Path | None, compile: bool = True) -> tuple[float, int]:
    """``python -m venv`` then ``pip install -r``: seconds, and the packages installed
    (pip, setuptools and the like not counted). ``cache``: pip's cache folder; None:
    ``--no-cache-dir``. ``compile``: pip's default; False: ``--no-compile``."""
    env = pip_env()
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=300)
    caching = ["--no-cache-dir"] if cache is None else ["--cache-dir", str(cache)]
    caching += [] if compile else ["--no-compile"]
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run(
        [*pip, "install", "-q", "--index-url", REGISTRY, *caching, "-r", str(req)],
        check=True,
        env=env,
        timeout=BUILD_LIMIT,
    )
    seconds = time.perf_counter() - started
    listed = subprocess.run(
        [*pip, "list", "--format", "freeze", "--exclude", "pip", "--exclude", "setuptools"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    return seconds, len(listed)


def builds(tmp: Path, quick: bool) -> list[Row]:
    """Parts 1 and 2: cold builds side by side, the second environment, warm builds."""
    first = requirements_file(tmp / "spec1", FIRST)
    second = requirements_file(tmp / "spec2", SECOND)
    uv_cache = tmp / "uv-cache"
    cold = timed(
        f"cold: gpufleet (uv {uv_version()}), empty uv cache and env root",
        tmp / "envs-a",
        uv_cache,
        first,
    )
    say(f"cold: python -m venv + pip {pip_version()} install --no-cache-dir ...")
    p_cold, p_n = pip_build(tmp / "pip-cold", first, None)
    say(f"  {p_cold:.1f} s, {p_n} packages")
    again = timed(
        "second environment (+ seaborn), same EnvCache, uv cache warm",
        tmp / "envs-a",
        uv_cache,
        second,
    )
    rows = [
        Row(
            f"cold build, {len(FIRST)} pinned ({cold.packages} packages), registry",
            f"gpufleet {cold.seconds:.1f} s (uv's bytecode step {cold.step('bytecode')}); "
            f"pip {p_cold:.1f} s: {p_cold / cold.seconds:.1f}x",
            "gpufleet >= 5x faster than venv + pip --no-cache-dir",
            p_cold / cold.seconds >= 5,
        ),
        Row(
            f"second env (+ seaborn, {again.packages} packages), same EnvCache, uv cache warm",
            f"{again.seconds:.1f} s (bytecode {again.step('bytecode')}): "
            f"{cold.seconds / again.seconds:.1f}x faster than gpufleet's cold build",
            ">= 10x faster than the first cold build",
            cold.seconds / again.seconds >= 10,
        ),
    ]
    warm = timed("warm: gpufleet, fresh env root, uv cache warm", tmp / "envs-b", uv_cache, first)
    if quick:
        return [
            *rows,
            Row(
                "warm build, fresh env, uv cache warm", f"gpufleet {warm.seconds:.1f} s", "-", None
            ),
        ]
    return rows + pip_pairs(tmp, first, cold, warm)


def timed(what: str, root: Path, uv_cache: Path, req: Path) -> Build:
    say(f"{what} ...")
    build = gpufleet_build(root, uv_cache, req)
    say(f"  {build.seconds:.1f} s, {build.packages} packages ({build.breakdown()})")
    return build


def pip_pairs(tmp: Path, req: Path, cold: Build, warm: Build) -> list[Row]:
    """Warm caches on both sides; and the cold pair without bytecode compilation."""
    pip_cache = tmp / "pip-cache"
    say("priming pip's cache (a pip install of the same requirements, not timed) ...")
    pip_build(tmp / "pip-prime", req, pip_cache)
    say("warm: python -m venv + pip install, pip's cache warm ...")
    p_warm, _ = pip_build(tmp / "pip-warm", req, pip_cache)
    say(f"  {p_warm:.1f} s")
    say("cold: python -m venv + pip install --no-cache-dir --no-compile ...")
    p_bare, _ = pip_build(tmp / "pip-bare", req, None, compile=False)
    say(f"  {p_bare:.1f} s")
    g_bare = cold.seconds - cold.steps.get("bytecode", 0.0)
    return [
        Row(
            "warm build (each tool's cache warm), fresh env",
            f"gpufleet {warm.seconds:.1f} s; pip {p_warm:.1f} s: {p_warm / warm.seconds:.1f}x",
            "-",
            None,
        ),
        Row(
            "cold build, no bytecode compiled (gpufleet: less uv's bytecode step)",
            f"gpufleet {g_bare:.1f} s; pip --no-compile {p_bare:.1f} s: {p_bare / g_bare:.1f}x",
            "-",
            None,
        ),
    ]


# --------------------------------------------------------------------------- dispatch


def dispatch(tmp: Path, jobs: int) -> list[Row]:
    """Part 3: jobs with a warm environment and jobs without one, taking turns."""
    wheels = tmp / "wheels"
    make_wheel(wheels, "gfdemo", "1.0")
    root = tmp / "fleet"
    root.mkdir()
    f = BenchFleet(root)
    f.env["UV_CACHE_DIR"] = str(tmp / "fleet-uv-cache")
    try:
        f.start_server(None)
        f.spawn(
            "worker",
            "worker",
            "--name",
            "bench",
            "--work-dir",
            str(root / "work"),
            "--env-cache-dir",
            str(root / "envs"),
            "--env-find-links",
            str(wheels),
        )
        with Client(f.url, f.token()) as c:
            return _dispatch_rows(c, jobs)
    finally:
        f.stop()


def _dispatch_rows(c: Client, jobs: int) -> list[Row]:
    deadline = time.monotonic() + 30
    while not c.workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the worker is in its long poll now
    environment = EnvironmentModel.model_validate({"with": ["gfdemo==1.0"]})
    _run(c, "build", environment, timeout=120)  # builds the environment: not counted
    for i in range(3):  # warm-up of both kinds: not counted
        _run(c, f"w{i}", None)
        _run(c, f"we{i}", environment)
    plain: list[float] = []
    warm: list[float] = []
    for i in range(jobs):  # taking turns, so a drift of the machine hits both alike
        order = ((plain, None), (warm, environment))
        for into, env in order if i % 2 == 0 else reversed(order):
            into.append(_run(c, f"d{i}", env))
    p50 = percentile(warm, 50) - percentile(plain, 50)
    return [
        Row(
            f"dispatch, created -> process started, {jobs} jobs each",
            f"warm env p50 {percentile(warm, 50):.1f} ms, p90 {percentile(warm, 90):.1f} ms; "
            f"no env p50 {percentile(plain, 50):.1f} ms, p90 {percentile(plain, 90):.1f} ms "
            f"(p50 {p50:+.1f} ms)",
            "p50 within 100 ms of each other",
            abs(p50) <= 100,
        )
    ]


def _run(c: Client, name: str, env: EnvironmentModel | None, timeout: float = 30) -> float:
    """Submit one job, wait for its end: created -> started, in ms."""
    job = c.submit(JobSpecModel(name=name, command=["python", "-c", "pass"], environment=env)).job
    done_by = time.monotonic() + timeout
    while (d := c.job(job.id)).status not in ("succeeded", "failed"):
        if time.monotonic() > done_by:
            raise SystemExit(f"job {job.id} did not finish in {timeout:.0f} s")
        time.sleep(0.01)
    if d.status != "succeeded" or d.started_at is None:
        raise SystemExit(f"job {job.id} ({name}) {d.status}: {d.error}")
    if env is not None and name != "build":
        used = d.history[-1].environment
        if used is None or used.built:
            raise SystemExit(f"job {job.id} did not run in the cached environment")
    time.sleep(0.05)  # let the worker get back into its poll
    return (d.started_at - d.created_at).total_seconds() * 1000


# --------------------------------------------------------------------------- output


def say(line: str) -> None:
    print(line, flush=True)


def uv_version() -> str:
    out = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


def pip_version() -> str:
    import pip

    return pip.__version__


def load() -> str:
    """The machine's load average over 1, 5 and 15 minutes: other work steals the CPU
    that uv's and pip's bytecode compilation both need."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def table(rows: Sequence[Row]) -> str:
    lines = ["| figure | measured | goal | |", "|---|---|---|---|"]
    for r in rows:
        verdict = "-" if r.met is None else ("met" if r.met else "**missed**")
        lines.append(f"| {r.figure} | {r.value} | {r.goal} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10 dispatch jobs, no warm pip pair")
    parser.add_argument("--jobs", type=int, default=None, help="dispatch jobs of each kind (30)")
    parser.add_argument("--tmp", type=Path, default=None, help="where temporary folders go")
    parser.add_argument(
        "--skip-builds", action="store_true", help="only the dispatch part (no network)"
    )
    args = parser.parse_args()
    jobs = args.jobs or (10 if args.quick else 30)
    if args.tmp is not None:
        args.tmp.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpufleet-envs-", dir=args.tmp))
    say(
        f"{date.today()}, {os.cpu_count()} cores (load {load()}), "
        f"Python {sys.version.split()[0]}, in {tmp}"
    )
    started = time.perf_counter()
    try:
        rows = [] if args.skip_builds else builds(tmp, args.quick)
        say(f"dispatch: {jobs} jobs with a warm environment, {jobs} without, taking turns ...")
        rows += dispatch(tmp, jobs)
    finally:
        remove_tree(tmp)  # the environments are sealed read-only
    say("")
    say(table(rows))
    say(f"\n(bench ran {time.perf_counter() - started:.0f} s; load now {load()})")


if __name__ == "__main__":
    main()
