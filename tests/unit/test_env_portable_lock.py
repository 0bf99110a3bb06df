"""A uv.lock a job brings (or the fleet recorded) is installed only from what the worker
reads: its index, else PyPI, or its own folder of wheels; nothing else is contacted."""

from __future__ import annotations

import pytest

from gpufleet.worker.envbuild import EnvError, portable_lock

PYPI_LOCK = """\
version = 1
[[package]]
name = "six"
version = "1.17.0"
source = { registry = "https://pypi.org/simple" }
sdist = { url = "https://files.pythonhosted.org/packages/six-1.17.0.tar.gz" }
wheels = [{ url = "https://files.pythonhosted.org/packages/six-1.17.0-py2.py3-none-any.whl" }]

[[package]]
name = "lab"
version = "0.1"
source = { virtual = "." }
"""
FOLDER_LOCK = """\
version = 1
[[package]]
name = "gfdemo"
version = "1.0"
source = { registry = "../w" }
wheels = [{ path = "gfdemo-1.0-py3-none-any.whl" }]
"""


def test_a_pypi_lock_installs_on_a_worker_that_reads_pypi() -> None:
    assert portable_lock(PYPI_LOCK, (), None) == PYPI_LOCK


@pytest.mark.parametrize(
    ("text", "find_links", "index", "said"),
    [
        (PYPI_LOCK, (), "http://mirror.lab/simple", "is not this worker's"),
        (PYPI_LOCK.replace("files.pythonhosted.org", "evil.example"), (), None, "is not on"),
        (
            PYPI_LOCK.replace("https://pypi.org/simple", "http://169.254.169.254/x"),
            (),
            None,
            "not this worker's",
        ),
        (FOLDER_LOCK, (), None, "folder of wheels"),
        (FOLDER_LOCK.replace("-py3-none-any.whl", ".txt"), ("/srv/w",), None, "not a wheel"),
    ],
)
def test_a_lock_that_reaches_elsewhere_is_refused_naming_the_package(
    text: str, find_links: tuple[str, ...], index: str | None, said: str
) -> None:
    with pytest.raises(EnvError) as caught:
        portable_lock(text, find_links, index)
    assert said in caught.value.message
    assert not caught.value.final  # another worker may read what this one does not


def test_a_folder_lock_reads_the_workers_own_folder() -> None:
    moved = portable_lock(FOLDER_LOCK, ("/srv/wheels",), None)
    assert 'registry = "/srv/wheels"' in moved and "../w" not in moved
    # a file is read by its name from the worker's folder, wherever the lock put it
    far = FOLDER_LOCK.replace('{ path = "gfdemo', '{ path = "../../etc/gfdemo')
    assert 'path = "gfdemo-1.0-py3-none-any.whl"' in portable_lock(far, ("/srv/w",), None)
