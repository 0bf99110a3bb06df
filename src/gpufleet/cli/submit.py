"""``gpufleet submit``: queue one job from the command line, optionally on a chosen
worker, optionally following it to its end and fetching its results."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpufleet.cli._common import (
    CaOpt,
    client,
    err,
    fields_signature,
    parse_pairs,
    print_json,
    setting_option,
    shown,
    styled,
)
from gpufleet.cli.choose import auto_select as auto_select_worker
from gpufleet.cli.choose import gets_text, interactive_select, read_session, session_token
from gpufleet.cli.data import fetch_results, job_inputs, package_inputs
from gpufleet.cli.environments import environment_model, spec_hint
from gpufleet.cli.jobs import default_name, follow
from gpufleet.cli.webhooks import notify_of
from gpufleet.client import Client
from gpufleet.domain.checkpoints import grace_signal
from gpufleet.domain.environments import EnvRequest
from gpufleet.errors import ConfigError, NotFound
from gpufleet.terminal import visible
from gpufleet.wire import EnvironmentModel, InputModel, JobSpecModel, RequirementsModel

if TYPE_CHECKING:
    from gpufleet.client.session import Session

# Each option is a named alias, so the command's signature reads as a list of names.
_Opt = typer.Option
Command = Annotated[
    list[str], typer.Argument(help="The command, after `--`: gpufleet submit -- python train.py")
]
Server = Annotated[str | None, setting_option("server")]
Name = Annotated[str | None, _Opt(help="Job name (default: the command's first words).")]
Notify = Annotated[
    str | None,
    _Opt(
        help="A URL to POST to when this job ends, fails or is preempted (a webhook of this "
        "job alone; Slack-compatible, signed); '-': read it from stdin, which keeps a "
        "secret URL out of the process list."
    ),
]
NotifySecretFile = Annotated[
    Path | None,
    _Opt(
        help="File holding --notify's signing secret ('-': stdin); default: the server "
        "makes one, printed once on stdout."
    ),
]
NotifyAfter = Annotated[
    str | None,
    _Opt(help="With --notify: also say when the job has run longer than this (90s, 30m, 2h, 1d)."),
]
RequireCuda = Annotated[bool, _Opt("--require-cuda", help="Run only on a worker with a GPU.")]
PreferCuda = Annotated[
    bool,
    _Opt("--prefer-cuda", help="Prefer a GPU; a CPU worker may take it after the grace window."),
]
MinVram = Annotated[float, _Opt(min=0, help="Minimum VRAM per GPU, GiB.")]
MinRam = Annotated[float, _Opt(min=0, help="Minimum host RAM, GiB.")]
Gpus = Annotated[int, _Opt(min=0, help="Number of GPUs (implies --require-cuda).")]
GpuName = Annotated[str | None, _Opt(help="GPU name glob, e.g. 'a100*' (implies a GPU).")]
Cpu = Annotated[
    bool,
    _Opt(
        "--cpu",
        help="Run in a CPU slot even on a chosen GPU worker (--worker, --session, "
        "--auto-select and --select otherwise give the job one of its GPUs).",
    ),
]
Label = Annotated[
    list[str] | None,
    _Opt(
        help="Worker label glob k=v (repeatable); a key naming a GPU (gpu_type=a100*) "
        "implies a GPU."
    ),
]
Host = Annotated[list[str] | None, _Opt(help="Allowed host name glob (repeatable).")]
Env = Annotated[list[str] | None, _Opt(help="Environment variable K=V for the job (repeatable).")]
Priority = Annotated[int, _Opt(help="Higher runs first.")]
MaxAttempts = Annotated[int, _Opt(min=1, help="Attempts before the job fails.")]
Timeout = Annotated[float | None, _Opt(min=0.001, help="Seconds before the job is killed.")]
NoRetryOn = Annotated[
    list[str] | None,
    _Opt(
        "--no-retry-on",
        metavar="CODES",
        help="Exit codes after which the job fails at once, attempts left or not "
        "(comma-separated or repeated, e.g. 4,5).",
    ),
]
RetryOn = Annotated[
    list[str] | None,
    _Opt(
        "--retry-on",
        metavar="CODES",
        help="Exit codes retried although the default does not retry them: 2 (a usage "
        "error), 126, 127 (comma-separated or repeated).",
    ),
]
Worker = Annotated[
    str | None,
    _Opt(help="Run on this worker (id or name); refused if it is busy, unless --queue."),
]
AutoSelect = Annotated[
    bool,
    _Opt(
        "--auto-select",
        help="Run on the GPU with the most free memory that can start the job now (never "
        "in a CPU slot unless --cpu); with --queue, when none can, wait for the first that "
        "frees.",
    ),
]
Select = Annotated[
    bool,
    _Opt(
        "--select",
        help="Pick the worker from a numbered list of those that can start the job now "
        "(r refreshes it).",
    ),
]
SessionString = Annotated[
    str | None,
    _Opt(
        help="Run on the worker whose session string this is (what it printed at start), "
        "or @FILE holding it; one that holds a token only as @FILE or GPUFLEET_SESSION.",
    ),
]
MinGpuMemory = Annotated[
    int,
    _Opt(
        min=0,
        metavar="MB",
        help="Needs a GPU with at least this much free memory, MiB (also filters "
        "--auto-select and --select).",
    ),
]
Queue = Annotated[
    bool,
    _Opt(
        "--queue",
        help="With a chosen worker that is busy: wait for it instead of refusing (with "
        "--auto-select: for the first GPU that frees).",
    ),
]
Shell = Annotated[bool, _Opt("--shell", help="Run the command through /bin/sh -c.")]
Package = Annotated[
    list[str] | None,
    _Opt(
        help="[DEST=]PATH: a folder, zip or file unpacked into the job directory "
        "(uploaded only if the server lacks it; repeatable)."
    ),
]
Input = Annotated[
    list[str] | None,
    _Opt(
        help="[DEST=]job:NAME_OR_ID: wait for that job to succeed and get its artifact "
        "(default DEST: inputs/NAME; repeatable)."
    ),
]
Output = Annotated[
    list[str] | None,
    _Opt(
        help="Glob of files (relative to the job directory) kept as the artifact "
        "(default: outputs; repeatable)."
    ),
]
CheckpointDir = Annotated[
    str | None,
    _Opt(
        "--checkpoint-dir",
        metavar="DIR",
        help="A folder (relative to the job directory) kept on the server while the job "
        "runs and restored into every later attempt (GPUFLEET_CHECKPOINT_DIR).",
    ),
]
GraceSignal = Annotated[
    str,
    _Opt(
        "--grace-signal",
        metavar="SIGNAL",
        help="What the job gets when gpufleet ends it to free its slot (a drain, a pause, "
        "its worker's SIGTERM): SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP or SIGQUIT.",
    ),
]
GracePeriod = Annotated[
    float,
    _Opt(
        "--grace-period",
        metavar="SECONDS",
        min=0,
        max=3600,
        help="Seconds the job has after its grace signal to save, before SIGKILL.",
    ),
]
Preemptible = Annotated[
    bool,
    _Opt(
        "--preemptible",
        help="A waiting job of a higher priority may preempt this one: its grace signal, "
        "its checkpoint kept, back to the queue (the server's sharing rules say when).",
    ),
]
Wait = Annotated[bool, _Opt("--wait", help="Follow the job to its end, then download its results.")]
Results = Annotated[
    Path | None, _Opt(help="With --wait: where to unpack the results (default: ./JOB_ID).")
]
Pool = Annotated[
    str | None, _Opt(help="Pool the job runs in (default: 'default', or the token's only pool).")
]
Json = Annotated[bool, _Opt("--json", help="Print JSON instead of a table.")]
WithRequirements = Annotated[
    Path | None,
    _Opt(
        "--with-requirements",
        help="Run in a Python environment the worker builds with uv from this "
        "requirements.txt, or pyproject.toml (with the uv.lock beside it, used as is).",
    ),
]
With = Annotated[
    list[str] | None,
    _Opt(
        "--with",
        metavar="REQ",
        help="A requirement of the job's environment, e.g. 'numpy>=2' (repeatable).",
    ),
]
Python = Annotated[
    str | None,
    _Opt(help="The Python version of the job's environment (3.12 or 3.12.4)."),
]
Upgrade = Annotated[
    bool,
    _Opt(
        "--upgrade",
        help="Resolve the environment's versions afresh instead of the fleet's recorded "
        "lock (which this resolution then replaces).",
    ),
]


@dataclass(kw_only=True)
class Placement:
    """Where a job may run and how it is queued: the options ``submit`` shares with the
    commands that submit jobs of their own (``sleap train``, ``sleap track``)."""

    server: Server = None
    ca: CaOpt = None
    require_cuda: RequireCuda = False
    prefer_cuda: PreferCuda = False
    min_vram_gib: MinVram = 0.0
    min_ram_gib: MinRam = 0.0
    gpus: Gpus = 0
    gpu_name: GpuName = None
    cpu: Cpu = False
    label: Label = None
    host: Host = None
    priority: Priority = 0
    max_attempts: MaxAttempts = 3
    no_retry_on: NoRetryOn = None
    retry_on: RetryOn = None
    timeout: Timeout = None
    worker: Worker = None
    auto_select: AutoSelect = False
    select: Select = False
    session: SessionString = None
    min_gpu_memory: MinGpuMemory = 0
    queue: Queue = False
    pool: Pool = None
    with_requirements: WithRequirements = None
    with_: With = None
    python: Python = None
    upgrade: Upgrade = False
    grace_signal: GraceSignal = "SIGTERM"
    grace_period: GracePeriod = 30.0
    preemptible: Preemptible = False
    as_json: Json = False
    # the session taken (its server, pool and worker are then these options'): not an option
    _taken: Any = field(default=None, init=False, repr=False)

    def connect(self) -> Client:
        """The client to submit with: a session's server and token, or the configured.
        Taking the session again (a second connection) changes nothing."""
        if self._taken is None:
            self._taken = (self._take_session(),)
        target = self._taken[0]
        token = session_token(target) if target is not None else None
        return client(self.server, self.ca, token=token)

    def _take_session(self) -> Session | None:
        """One way of choosing the worker at most; a session names the server, pool and
        worker (and gives the token to send)."""
        chosen = [
            flag
            for flag, on in (
                ("--worker", self.worker),
                ("--auto-select", self.auto_select),
                ("--select", self.select),
                ("--session", self.session),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)}: choose the worker one way only")
        target = read_session(self.session)
        if target is None:
            return None
        if self.pool is not None and self.pool != target.pool:
            said = f"the session's worker is in pool {target.pool!r}"
            raise ConfigError(f"--pool {self.pool}: {said}")
        self.server, self.pool, self.worker = target.server, target.pool, target.worker
        return target

    def requirements(self) -> RequirementsModel:
        return RequirementsModel(
            require_cuda=self.require_cuda or self.gpus > 0 or self.min_gpu_memory > 0,
            prefer_cuda=self.prefer_cuda,
            gpu_count=self.gpus,
            min_vram_gib=max(self.min_vram_gib, self.min_gpu_memory / 1024),
            min_ram_gib=self.min_ram_gib,
            gpu_name=self.gpu_name,
            labels=parse_pairs(self.label or [], "--label"),
            allowed_hosts=self.host or [],
            worker=self.worker,
            cpu_only=self.cpu,
        )

    def placed(self, c: Client, probe: JobSpecModel, wait: bool | None = None) -> RequirementsModel:
        """The job's requirements, aimed at the worker ``--auto-select`` or ``--select``
        picks for ``probe`` (a job like the ones to submit) when either was given. When
        no GPU can start it now and ``wait`` (default: ``--queue``), ``--auto-select``
        leaves it unaimed, needing a GPU: it runs on the first that frees."""
        requirements = probe.requirements
        if not (self.auto_select or self.select):
            return requirements
        wait = self.queue if wait is None else wait
        if not self.auto_select:
            pick = interactive_select(c, probe)
        elif (chosen := auto_select_worker(c, probe, wait)) is not None:
            pick = chosen
        else:
            cpu = requirements.cpu_only
            what = "a CPU slot" if cpu else "a GPU"
            err.print(f"no worker can start it on {what} now: queued for the first that frees")
            return requirements if cpu else requirements.model_copy(update={"require_cuda": True})
        got = gets_text(pick)
        err.print(
            f"worker {shown(pick.worker.name)} ({shown(pick.worker.id)}) chosen: {shown(got)}"
        )
        return requirements.model_copy(update={"worker": pick.worker.id})

    def mounts_pool(self, c: Client, packages: list[str] | None) -> str:
        """The pool whose workers' mounts a package's path may lie on."""
        if self.pool is not None or not packages:
            return self.pool or "default"
        me = c.whoami()
        return "default" if not me.pools or "default" in me.pools else me.pools[0]

    def env_request(self) -> EnvRequest | None:
        """The environment these options name, or None (the worker's own Python)."""
        req = EnvRequest(
            with_requirements=str(self.with_requirements) if self.with_requirements else None,
            with_=tuple(self.with_ or ()),
            python=self.python,
            upgrade=self.upgrade,
        )
        if req.empty:
            if self.upgrade:
                raise ConfigError("--upgrade: the job names no environment to resolve")
            return None
        return req

    def environment(self, c: Client, packages: list[str] | None) -> EnvironmentModel | None:
        """The job's environment, its files uploaded; without one, a note when a package
        brings a spec it does not use."""
        req = self.env_request()
        if req is None:
            hint = spec_hint(packages or [])
            if hint and not self.as_json:
                err.print(f"[yellow]note:[/yellow] {shown(hint)}")
            return None
        return environment_model(c, req)

    def queued(self) -> dict[str, Any]:
        """The spec fields these options set besides the requirements."""
        return {
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "no_retry_on": exit_codes(self.no_retry_on, "--no-retry-on"),
            "retry_on": exit_codes(self.retry_on, "--retry-on"),
            "timeout": self.timeout,
            "pool": self.pool,
            "grace_signal": grace_signal_name(self.grace_signal),
            "grace_period": self.grace_period,
            "preemptible": self.preemptible,
        }


@dataclass(kw_only=True)
class SubmitRequest(Placement):
    """What ``gpufleet submit`` was asked (its options, declared once: the command's
    signature is made from these fields), and the steps that turn it into a queued job."""

    command: Command
    name: Name = None
    env: Env = None
    shell: Shell = False
    package: Package = None
    input: Input = None
    output: Output = None
    checkpoint_dir: CheckpointDir = None
    wait: Wait = False
    results: Results = None
    notify: Notify = None
    notify_secret_file: NotifySecretFile = None
    notify_after: NotifyAfter = None

    def run(self) -> None:
        with self.connect() as c:
            inputs = job_inputs(self.input or [])  # checked before anything is uploaded
            name = self.name or default_name(self.command)
            probe = JobSpecModel(
                name=name, command=self.command, requirements=self.requirements(), pool=self.pool
            )
            requirements = self.placed(c, probe)
            pool = self.mounts_pool(c, self.package)
            packages = package_inputs(c, self.package or [], pool, self.as_json)
            inputs = packages + inputs
            spec = self.spec(requirements, inputs)
            spec.environment = self.environment(c, self.package)
            result = c.submit(spec, queue=self.queue)
            if self.notify:
                notify_of(c, result.job.id, self.notify, self.notify_secret_file, self.notify_after)
            if result.warning:
                err.print(f"[yellow]warning:[/yellow] {shown(result.warning)}")
            if not self.wait:
                print_json(result) if self.as_json else print(visible(result.job.id))
                return
            following = "following it (Ctrl-C stops following only)"
            err.print(f"job {shown(result.job.id)} queued; {following}")
            status = follow(c, result.job.id, self.as_json)
            finish_wait(c, result.job.id, status, self.results, self.as_json)

    def spec(self, requirements: RequirementsModel, inputs: list[InputModel]) -> JobSpecModel:
        return JobSpecModel(
            name=self.name or default_name(self.command),
            command=[" ".join(self.command)] if self.shell else self.command,
            env=parse_pairs(self.env or [], "--env"),
            requirements=requirements,
            shell=self.shell,
            inputs=inputs,
            **self.queued(),
            outputs=self.output or ["outputs"],
            checkpoint_dir=self.checkpoint_dir,
        )


_EXIT_CODE = re.compile(r"-?[0-9]+")


def grace_signal_name(given: str) -> str:
    """``TERM``, ``sigusr1`` or ``15`` as the signal's name (SIGTERM, SIGUSR1)."""
    try:
        return grace_signal(given).name
    except ValueError as exc:
        raise ConfigError(f"--grace-signal: {visible(str(exc))}") from None


def exit_codes(given: list[str] | None, flag: str) -> list[int]:
    """``4,5`` (or the flag repeated) as exit codes; the server checks their range."""
    words = [w.strip() for w in ",".join(given or []).split(",") if w.strip()]
    for word in words:  # ASCII digits only: int() would also take "\uff11", "1_0", "+4"
        if not _EXIT_CODE.fullmatch(word):
            raise ConfigError(
                f"{flag}: {visible(word)!r} is not an exit code (a whole number, as in 4,5)"
            )
    return [int(w) for w in words]


def finish_wait(c: Client, job_id: str, status: str, results: Path | None, quiet: bool) -> None:
    """After ``--wait``: fetch the results, say where they are, exit non-zero unless the
    job succeeded."""
    where = None
    try:
        where = fetch_results(c, job_id, results, quiet)
    except NotFound as exc:  # the server says why: nothing kept, or nothing written
        err.print(shown(exc.message))
    if quiet:
        print_json({"job_id": job_id, "status": status, "results": str(where) if where else None})
    else:
        err.print(
            f"job {shown(job_id)} {styled(status)}"
            + (f"; results in {shown(str(where))}" if where else "")
        )
        print(visible(job_id))
    if status != "succeeded":
        raise typer.Exit(1)


def submit(**asked: Any) -> None:
    """Queue one job. Prints the job id alone on the last line (with --wait: follows it,
    downloads its results, and exits non-zero unless it succeeded)."""
    SubmitRequest(**asked).run()


submit.__signature__ = fields_signature(SubmitRequest)  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(submit)
