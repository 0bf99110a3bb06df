"""A worker reads its pool's lock of an environment and uses it only when it holds
pinned registry packages: anything else is ignored, said in the job's log, and the
build resolves for itself (gpufleet.worker.envphase)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.client import _ops as ops
from gpufleet.domain.environments import EnvKind
from gpufleet.worker.envphase import EnvPhase

UV_LOCK = 'version = 1\n\n[[package]]\nname = "gfdemo"\nversion = "1.0"\nsource = { %s }\n'


def phase(tmp_path: Path, text: str, asked: list[tuple[str, str | None]]) -> EnvPhase:
    """An EnvPhase of pool ``lab`` whose server answers a lock holding ``text``."""
    blob = tmp_path / "lock"
    blob.write_text(text, encoding="utf-8")

    async def env_lock(key: str, pool: str | None = None) -> Any:
        asked.append((key, pool))
        return SimpleNamespace(sha256="1" * 64, job_id="j-1", worker_name="box")

    async def get(sha256: str) -> tuple[Path, int]:
        return blob, len(text)

    async def retrying(what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        return await call()

    fakes: Any = SimpleNamespace(
        client=SimpleNamespace(env_lock=env_lock),
        blobs=SimpleNamespace(get=get, release=lambda sha256: None),
    )
    return EnvPhase(
        cache=fakes,
        client=fakes.client,
        data=fakes,
        blobs=fakes.blobs,
        capability=fakes,
        retrying=retrying,
        pool="lab",
    )


@pytest.mark.parametrize(
    ("kind", "text", "used"),
    [
        (EnvKind.REQUIREMENTS, "gfdemo==1.0\n    # via -r requirements.in\n", True),
        (EnvKind.REQUIREMENTS, "-r /etc/shadow\ngfdemo==1.0\n", False),
        (EnvKind.REQUIREMENTS, "gfdemo @ https://host/gfdemo.whl\n", False),
        (EnvKind.PROJECT, UV_LOCK % 'registry = "https://pypi.org/simple"', True),
        (EnvKind.PROJECT, UV_LOCK % 'git = "https://host/gfdemo"', False),
    ],
)
def test_a_recorded_lock_is_used_only_when_it_pins_registry_packages(
    tmp_path: Path, kind: EnvKind, text: str, used: bool
) -> None:
    asked: list[tuple[str, str | None]] = []
    said: list[str] = []
    got = asyncio.run(phase(tmp_path, text, asked)._fleet_lock("k" * 64, kind, said.append, False))
    assert asked == [("k" * 64, "lab")]  # the worker's own pool's lock
    assert got == (text if used else None)
    assert any("ignoring the recorded lock" in line for line in said) is not used, said


def test_the_pool_is_sent_only_when_the_worker_knows_it() -> None:
    assert ops.env_lock("k" * 64).params == {}  # the token's only pool
    assert ops.env_lock("k" * 64, "lab").params == {"pool": "lab"}
