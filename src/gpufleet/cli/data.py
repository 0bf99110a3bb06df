"""Commands that move bytes: blobs put/get/ls, download, and the package and results
helpers behind ``submit --package`` / ``--wait``. Progress bars go to stderr and only on
a terminal (never with ``--json``)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from gpufleet.cli._common import (
    CaOpt,
    SessionOpt,
    client,
    err,
    out,
    print_json,
    setting_option,
    shown,
    when,
)
from gpufleet.cli.choose import session_client
from gpufleet.client import Client
from gpufleet.domain.manifest_values import default_job_dest, split_dest
from gpufleet.errors import GpufleetError, InsufficientStorage
from gpufleet.wire import InputModel, WorkerOut

if TYPE_CHECKING:
    from rich.progress import Progress

    from gpufleet.client._transfer import Progress as Advance

# Archives and progress bars are imported where they are used: every command
# pays for what this module imports at start, and `blobs get` needs none of them.

ServerOpt = Annotated[str | None, setting_option("server")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON, no progress bars.")]
blobs_app = typer.Typer(help="Content-addressed blobs on the server (power users, scripts).")


def register(app: typer.Typer) -> None:
    app.add_typer(blobs_app, name="blobs", no_args_is_help=True)
    app.command()(download)


@contextlib.contextmanager
def bars(quiet: bool) -> Iterator[Progress | None]:
    """A Rich progress display on stderr, or None when quiet or not on a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        yield progress


def bar(progress: Progress | None, what: str, total: int | None) -> Advance:
    if progress is None:
        return lambda _n: None
    task = progress.add_task(shown(what), total=total)
    return lambda n: progress.advance(task, n)


def os_error(exc: OSError, what: str) -> GpufleetError:
    if exc.errno == 28:  # ENOSPC
        return InsufficientStorage(f"no space left on device while {what}; nothing was kept")
    return GpufleetError(f"{what}: {exc.strerror or exc}")


# ---- blobs ----------------------------------------------------------------------------


@blobs_app.command("put")
def blobs_put(
    file: Annotated[Path, typer.Argument(help="The file to upload.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload a file as a blob (skipped when the server has it); prints its SHA-256."""
    if not file.is_file():
        raise GpufleetError(f"{file}: no such file")
    size = file.stat().st_size
    from gpufleet.client._packages import put_remembered

    with client(server, ca) as c, bars(as_json) as progress:
        sent = put_remembered(c, file, bar(progress, f"upload {file.name}", size))
    if as_json:
        print_json({"sha256": sent.sha256, "size": sent.size, "sent": sent.sent})
        return
    if not sent.sent and size:
        err.print("the server already had it: nothing sent")
    print(sent.sha256)


@blobs_app.command("get")
def blobs_get(
    sha256: Annotated[str, typer.Argument(help="The blob's SHA-256.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write it.")],
    server: ServerOpt = None,
    ca: CaOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Download a blob, verified by its hash; an interrupted download resumes."""
    with client(server, ca) as c, bars(quiet) as progress:
        size = c.has_blob(sha256)
        if size is None:
            raise GpufleetError(f"the server has no blob {sha256}")
        try:
            c.get_blob(sha256, output, progress=bar(progress, f"download {sha256[:12]}", size))
        except OSError as exc:
            raise os_error(exc, f"writing {output}") from exc
    err.print(f"{shown(output)}: {size} bytes, verified")


@blobs_app.command("ls")
def blobs_ls(
    server: ServerOpt = None,
    ca: CaOpt = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many blobs.")] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List blobs, newest first."""
    with client(server, ca) as c:
        rows = c.blobs(limit)
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("SHA256", "SIZE", "CREATED"):
        table.add_column(col)
    for b in rows:
        table.add_row(shown(b.sha256), str(b.size), when(b.created_at))
    out.print(table)


# ---- results --------------------------------------------------------------------------


def fetch_results(c: Client, job: str, dest: Path | None, quiet: bool) -> Path | None:
    """Download and unpack a job's artifact into ``dest`` (default ``./JOB_ID``);
    None when the job left none. Existing files are never overwritten."""
    from gpufleet import archive

    art = c.artifact(job)
    dest = (dest or Path(art.job_id)).resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gpufleet-dl-", dir=dest.parent) as tmp:
        blob = Path(tmp) / "artifact.tar.zst"
        try:
            with bars(quiet) as progress:
                c.get_blob(art.sha256, blob, bar(progress, f"download {job}", art.size))
            unpacked = Path(tmp) / "unpacked"
            with open(blob, "rb") as f:
                archive.extract(f, unpacked, compressed_size=art.size)
            archive.merge_into(unpacked, dest)
        except OSError as exc:
            raise os_error(exc, f"downloading the results of {job} into {dest}") from exc
    return dest


def download(
    job: Annotated[str, typer.Argument(help="Job id (or a name that only one job has).")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Folder to unpack into (default: ./JOB_ID)."),
    ] = None,
    server: ServerOpt = None,
    ca: CaOpt = None,
    session: SessionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download a job's artifact (its outputs) and unpack it."""
    with session_client(server, ca, session) as c:
        dest = fetch_results(c, job, output, as_json)
        art = c.artifact(job)
    if as_json:
        print_json(
            {"job_id": art.job_id, "path": str(dest), "artifact": art.model_dump(mode="json")}
        )
        return
    out.print(f"{art.file_count} file(s) from {shown(art.job_id)} in {shown(str(dest))}")


# ---- inputs for submit ----------------------------------------------------------------


def package_inputs(
    c: Client, packages: list[str], pool: str, quiet: bool, base: Path | None = None
) -> list[InputModel]:
    """``[DEST=]PATH`` items as inputs: paths on a mount some worker of ``pool`` declared
    are passed by reference; everything else is packaged and uploaded if new."""
    workers: list[WorkerOut] | None = None
    found = []
    for item in packages:
        dest, path = _package_arg(item, base)
        if workers is None:
            workers = c.workers()
        found.append(package_input(c, path, dest, pool, quiet, workers))
    return found


def package_input(
    c: Client,
    path: Path,
    dest: str | None,
    pool: str,
    quiet: bool,
    workers: list[WorkerOut] | None = None,
    root: str = "",
) -> InputModel:
    """``path`` as an input at ``dest``: by reference when it lies on a mount some worker
    of ``pool`` declared, else packaged and uploaded if the server lacks it. With ``root``
    (a zip's folder to unpack) it is always packaged: a reference is not unpacked."""
    from gpufleet.client._packages import mounted, package, workers_sharing

    sharing = (
        [] if root else workers_sharing(path, c.workers() if workers is None else workers, pool)
    )
    if sharing:
        err.print(
            f"{shown(str(path))}: on a shared mount ({shown(', '.join(sharing))}); "
            "passed by reference"
        )
        return mounted(path, dest)
    with bars(quiet) as progress:
        result = package(
            c,
            path,
            dest or ".",
            lambda _w, label, size: bar(progress, f"upload {label}", size),
            root=root,
        )
    if not quiet:
        how = "unchanged, " if result.reused else ""
        err.print(
            f"package {shown(path.name)}: {how}{result.sent} bytes sent ({result.input.ref[:12]})"
        )
    return result.input


def _package_arg(item: str, base: Path | None) -> tuple[str | None, Path]:
    whole = (base or Path.cwd()) / item
    if whole.exists():
        return None, whole
    dest, path = split_dest(item)
    return dest, (base or Path.cwd()) / path


def job_inputs(items: list[str]) -> list[InputModel]:
    """``job:NAME`` / ``DEST=job:NAME`` items as inputs."""
    found = []
    for item in items:
        dest, ref = split_dest(item)
        if not ref.startswith("job:") or len(ref) == 4:
            raise GpufleetError(f"--input {item!r}: expected job:NAME or DEST=job:NAME")
        found.append(
            InputModel(kind="job", ref=ref[4:], dest=dest or default_job_dest(ref[4:]), label=ref)
        )
    return found
