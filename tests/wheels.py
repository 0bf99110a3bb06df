"""Wheels written by hand, for tests that point uv at a local folder instead of PyPI.

``make_wheel(folder, "gfdemo", "1.0")`` writes ``folder/gfdemo-1.0-py3-none-any.whl``: a
valid pure-Python wheel (uv and pip install it) holding one module, ``gfdemo/__init__.py``
with ``__version__ = "1.0"`` and a ``main()`` that prints it, and its ``.dist-info``
(METADATA, WHEEL, RECORD with the SHA-256 of each file, and entry_points.txt when it has
console scripts). No setuptools, no build, no network: a few milliseconds a wheel.

A test's folder of wheels then serves as the whole index::

    make_wheel(tmp_path / "wheels", "gfdemo", "1.0")
    make_wheel(tmp_path / "wheels", "gfdemo", "1.1")
    uv pip install --no-index --find-links tmp_path/wheels gfdemo   # -> 1.1
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

# A fixed time for every zip entry, so the same wheel has the same bytes each time.
_STAMP = (2020, 1, 1, 0, 0, 0)
# The module's entry point for its console scripts.
_MAIN = "def main():\n    print(__version__)\n"


def make_wheel(
    folder: Path,
    name: str,
    version: str,
    requires: Sequence[str] = (),
    scripts: Sequence[str] = (),
    module: str | None = None,
) -> Path:
    """Write a pure-Python wheel of ``name`` at ``version`` into ``folder`` (made if
    missing) and return its path. ``requires``: its dependencies, as requirement strings
    (``Requires-Dist``), for tests of a resolution across packages. ``scripts``: names
    of console scripts that run its ``main()`` (print the version). ``module``: the
    module's own source instead (it must define ``main()`` for scripts)."""
    dist = re.sub(r"[-_.]+", "_", name).lower()  # the wheel's own spelling of the name
    info = f"{dist}-{version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    files = {
        f"{dist}/__init__.py": module or f'__version__ = "{version}"\n\n\n{_MAIN}',
        f"{info}/METADATA": "\n".join(metadata) + "\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: gpufleet-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    if scripts:
        lines = "".join(f"{script} = {dist}:main\n" for script in scripts)
        files[f"{info}/entry_points.txt"] = "[console_scripts]\n" + lines
    record = [_record_line(path, text.encode()) for path, text in files.items()]
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, text in files.items():
            entry = zipfile.ZipInfo(member, _STAMP)
            entry.external_attr = 0o644 << 16  # rw-r--r--, as installers expect
            zf.writestr(entry, text)
    return path


def _record_line(path: str, data: bytes) -> str:
    """A RECORD line: the path, ``sha256=`` and the urlsafe base64 of the hash
    (unpadded), and the size."""
    raw = hashlib.sha256(data).digest()
    digest = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def slow_uv(folder: Path, seconds: float) -> Path:
    """A stand-in ``uv`` package whose ``find_uv_bin`` names a wrapper of the real uv that
    sleeps ``seconds`` before ``uv pip sync``: a build that takes a while, to watch or to
    cancel. Returns the folder to put first on a worker's PYTHONPATH."""
    import uv

    wrapper = folder / "bin" / "uv"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "pip sync" ]; then sleep {seconds:g}; fi\n'
        f'exec "{uv.find_uv_bin()}" "$@"\n'
    )
    wrapper.chmod(0o755)
    package = folder / "path" / "uv"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"def find_uv_bin():\n    return {str(wrapper)!r}\n")
    return package.parent
