"""The folders of the environment cache, and the operations on them: read an env's meta,
install a finished build, hold an env for a job, remove one nobody holds, list them.
Policy (what to build, what to evict) sits above, in :mod:`gpufleet.worker.environments`.

::

    envs/<build key>/     a venv, sealed (no write permission for anyone)
    meta/<build key>.json what it is: spec, Python, versions, lock, size, survey digest
    locks/<key>.build     held (exclusive) while one process builds the key
    locks/<key>.use       held (shared) by each job using the env; its mtime: last use
    tmp/                  builds in progress, renamed into envs/ when done

An env is *whole* when ``envs/<key>`` and its meta are both there: a build writes the
meta, then renames its folder into ``envs/``; a removal takes the meta away, then renames
the folder out to ``tmp/`` before deleting it. Every lock is an ``flock``, so it holds
across the processes of several workers sharing the folder, and ends with its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from gpufleet.worker import envtree
from gpufleet.worker.staging import human


class Hold:
    """An env in use by a running job: a shared ``flock`` on its ``.use`` file, which
    eviction (taking it exclusively) cannot get meanwhile, in any process. Release it
    once, when the job ends; closing the file releases the lock (also if the worker dies).
    """

    def __init__(self, key: str, fd: int) -> None:
        self.key = key
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@dataclass(frozen=True)
class EnvInfo:
    """One cached environment, for ``gpufleet workers``."""

    key: str
    spec_key: str
    spec: str  # EnvSpec.describe()
    python: str
    torch_backend: str | None
    size: int
    built_at: float
    last_used: float
    in_use: bool

    def describe(self, now: float | None = None) -> str:
        """One line: short key, Python, torch build, size, what it is built from, use."""
        ago = max(0, int((time.time() if now is None else now) - self.last_used))
        use = "in use" if self.in_use else f"last used {_duration(ago)} ago"
        torch = f" torch {self.torch_backend}" if self.torch_backend else ""
        size = human(self.size)
        return f"{self.key[:12]}  Python {self.python}{torch}  {size}  {self.spec}  {use}"


class EnvStore:
    """The cache's folders under ``root``."""

    def __init__(self, root: Path) -> None:
        root = root.absolute()  # uv runs in other folders: every path it is given is whole
        self.envs, self.meta, self.locks, self.tmp = (
            root / "envs",
            root / "meta",
            root / "locks",
            root / "tmp",
        )
        root.mkdir(parents=True, exist_ok=True)
        # Jobs (other users, with --run-as) pass through envs/ to their env; the rest is
        # the worker's own.
        for folder, mode in ((self.envs, 0o711), (self.meta, 0o700), (self.locks, 0o700)):
            folder.mkdir(exist_ok=True)
            folder.chmod(mode)
        self.tmp.mkdir(mode=0o700, exist_ok=True)

    def env(self, key: str) -> Path:
        return self.envs / key

    def temp(self, key: str, suffix: str = "") -> Path:
        """A fresh name in ``tmp/`` for work on ``key`` (the key first: see leftovers)."""
        return self.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"

    def lock_file(self, key: str, kind: str) -> int:
        """An open descriptor of ``locks/<key>.<kind>`` (kind: build or use)."""
        return os.open(self.locks / f"{key}.{kind}", os.O_RDWR | os.O_CREAT, 0o600)

    # ----------------------------------------------------------------- reading

    def read_meta(self, key: str) -> dict[str, Any] | None:
        try:
            meta = json.loads((self.meta / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def whole(self, key: str) -> bool:
        return (self.meta / f"{key}.json").is_file() and (self.env(key) / "pyvenv.cfg").is_file()

    def intact(self, key: str) -> bool:
        """Whether the env is whole and as it was built (its survey unchanged)."""
        meta = self.read_meta(key)
        if meta is None or not self.whole(key):
            return False
        return envtree.survey(self.env(key)).digest == meta.get("survey")

    def ready(self, key: str) -> dict[str, Any] | None:
        """The meta of an env that is whole and unchanged, else None. Its files are
        surveyed only when a job that could have changed it used it since its last
        check (:meth:`unchecked`): a warm start of an environment of 30,000 files does
        not walk them."""
        meta = self.read_meta(key)
        if meta is None or not self.whole(key):
            return None
        if self.unchecked_file(key).exists():
            if not self.intact(key):
                return None
            self.checked(key)
        return meta

    def unchecked_file(self, key: str) -> Path:
        return self.meta / f"{key}.unchecked"

    def unchecked(self, key: str) -> None:
        """A job that could change the env (one running as the worker's own user, or
        root) uses it: until a survey finds it unchanged, it is not taken as ready."""
        self.unchecked_file(key).touch()

    def checked(self, key: str) -> None:
        """A survey found the env unchanged: it is ready again, unless a job (which may
        be changing it) still holds it."""
        if not self.held(key):
            self.unchecked_file(key).unlink(missing_ok=True)

    def infos(self, in_use: bool) -> list[EnvInfo]:
        """Every whole env (``in_use``: find out which are held, else all say False)."""
        infos = []
        for path in self.meta.glob("*.json"):
            key = path.stem
            meta = self.read_meta(key)
            if meta is None or not self.whole(key):
                continue
            built_at = float(meta.get("built_at", 0.0))
            infos.append(
                EnvInfo(
                    key=key,
                    spec_key=str(meta.get("spec_key", "")),
                    spec=str(meta.get("spec", "")),
                    python=str(meta.get("python", "")),
                    torch_backend=meta.get("torch_backend"),
                    size=int(meta.get("size", 0)),
                    built_at=built_at,
                    last_used=self._last_used(key, built_at),
                    in_use=in_use and self.held(key),
                )
            )
        return infos

    def _last_used(self, key: str, default: float) -> float:
        try:
            return (self.locks / f"{key}.use").stat().st_mtime
        except OSError:
            return default

    def held(self, key: str) -> bool:
        """Whether a job (of any process) holds the env now."""
        fd = self.lock_file(key, "use")
        try:
            return not try_lock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- changing

    def use(self, key: str) -> Hold:
        """Take ``locks/<key>.use`` shared and touch it (its mtime: the last use)."""
        fd = self.lock_file(key, "use")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a removal holds it only while it renames
            os.utime(fd)
        except BaseException:
            os.close(fd)
            raise
        return Hold(key, fd)

    def install(self, key: str, temp: Path, meta: dict[str, Any]) -> Hold:
        """Make a finished (sealed) build in ``temp`` the env of ``key``: its meta first,
        then the folder renamed into place, held from before it is there (another
        process's eviction cannot take it first)."""
        hold = self.use(key)
        try:
            _write_json(self.meta / f"{key}.json", meta)
            os.chmod(temp, 0o755)  # a folder is renamed only with write permission on it
            os.replace(temp, self.env(key))
            os.chmod(self.env(key), 0o555)
        except BaseException:
            hold.release()
            raise
        return hold

    def write_meta(self, key: str, meta: dict[str, Any]) -> None:
        _write_json(self.meta / f"{key}.json", meta)

    def remove_unheld(self, key: str) -> bool:
        """Remove an env unless it is held (whether it is gone): under the exclusive use
        lock its meta goes and its folder is renamed away, then it is deleted."""
        fd = self.lock_file(key, "use")
        gone = self.temp(key, ".gone")
        try:
            if not try_lock(fd, fcntl.LOCK_EX):
                return False
            (self.meta / f"{key}.json").unlink(missing_ok=True)
            self.unchecked_file(key).unlink(missing_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.env(key), 0o755)
                os.replace(self.env(key), gone)
        finally:
            os.close(fd)
        envtree.remove_tree(gone)
        return True

    def remove_leftovers(self) -> int:
        """Remove what killed builds left in ``tmp/``: each entry whose key no process
        is building now (its build lock is free). How many went."""
        removed = 0
        for path in self.tmp.iterdir():
            fd = self.lock_file(path.name.split(".", 1)[0], "build")
            try:
                if try_lock(fd, fcntl.LOCK_EX):
                    envtree.remove_tree(path)
                    removed += 1
            finally:
                os.close(fd)
        return removed


def try_lock(fd: int, how: int) -> bool:
    """Take an flock without waiting; whether it was taken."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_json(path: Path, body: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    temp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(temp, path)


def _duration(seconds: int) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
