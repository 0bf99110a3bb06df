"""A job's environment spec: its keys name the same request the same way everywhere, and
a worker's torch build follows its GPUs and driver (gpufleet.domain.environments)."""

from __future__ import annotations

import pytest

from gpufleet.domain.environments import (
    EnvFile,
    EnvKind,
    EnvSpec,
    build_key,
    lock_key,
    names_torch,
    normalize_requirement,
    pyproject_problem,
    requirement_problem,
    requirements_text_problem,
    torch_backend_for,
    uv_lock_problem,
)

REQS = EnvFile("requirements.txt", "a" * 64, 10)
PROJECT = EnvFile("pyproject.toml", "b" * 64, 20)
LOCK = EnvFile("uv.lock", "c" * 64, 30)


def test_with_strings_count_as_a_set_whatever_their_order_and_spelling() -> None:
    one = EnvSpec(with_=("Numpy >= 2", "gfdemo"))
    other = EnvSpec(with_=("gfdemo", "numpy>=2"))
    assert one.key() == other.key()
    assert normalize_requirement("Foo_Bar.baz [x] >= 1") == "foo-bar-baz[x]>=1"


def test_what_changes_the_request_changes_the_spec_key_and_upgrade_does_not() -> None:
    base = EnvSpec(requirements=REQS, python="3.11")
    assert base.key() != EnvSpec(requirements=REQS, python="3.12").key()
    assert base.key() != EnvSpec(requirements=EnvFile("r.txt", "d" * 64, 1), python="3.11").key()
    assert base.key() != EnvSpec(requirements=REQS, python="3.11", with_=("x",)).key()
    assert base.key() == EnvSpec(requirements=REQS, python="3.11", upgrade=True).key()


def test_a_project_spec_is_locked_only_with_its_uv_lock() -> None:
    project = EnvSpec(project=PROJECT)
    assert project.kind is EnvKind.PROJECT and not project.locked
    locked = EnvSpec(project=PROJECT, lock=LOCK)
    assert locked.locked and locked.files == (PROJECT, LOCK)
    assert EnvSpec(requirements=REQS).kind is EnvKind.REQUIREMENTS
    assert locked.describe() == "pyproject.toml + uv.lock"
    assert EnvSpec().describe() == "(empty)"


def test_the_lock_key_is_per_python_minor_and_torch_build() -> None:
    spec = EnvSpec(requirements=REQS).key()
    assert lock_key(spec, "3.11.2", "cpu") == lock_key(spec, "3.11.7", "cpu")
    assert lock_key(spec, "3.11.2", "cpu") != lock_key(spec, "3.12.1", "cpu")
    assert lock_key(spec, "3.11.2", "cpu") != lock_key(spec, "3.11.2", "cu128")
    assert lock_key(spec, "3.11.2", None) != lock_key(spec, "3.11.2", "cpu")


def test_the_build_key_holds_the_exact_python_the_platform_and_the_options() -> None:
    spec = EnvSpec(requirements=REQS).key()
    key = build_key(spec, "3.11.7", "linux-x86_64", {"torch": "cpu"})
    assert key != build_key(spec, "3.11.2", "linux-x86_64", {"torch": "cpu"})
    assert key != build_key(spec, "3.11.7", "linux-aarch64", {"torch": "cpu"})
    assert key != build_key(spec, "3.11.7", "linux-x86_64", {"torch": "cu128"})
    assert key == build_key(spec, "3.11.7", "linux-x86_64", {"torch": "cpu"})


def test_the_torch_build_is_the_newest_the_driver_runs_and_cpu_without_gpus() -> None:
    assert torch_backend_for("12.8", gpus=2) == "cu128"
    assert torch_backend_for("12.7", gpus=1) == "cu126"
    assert torch_backend_for("13.1", gpus=1) == "cu130"
    assert torch_backend_for("11.4", gpus=1) == "cpu"  # older than any CUDA build
    assert torch_backend_for("12.8", gpus=0) == "cpu"
    assert torch_backend_for(None, gpus=2) == "cpu"
    assert torch_backend_for("garbage", gpus=2) == "cpu"


def test_torch_is_named_by_a_requirement_not_by_a_word_that_contains_it() -> None:
    assert names_torch(["numpy\ntorch==2.5\n"])
    assert names_torch(['dependencies = ["torchvision>=0.2"]'])
    assert names_torch(["Torch_Audio"]) is False  # not a PyTorch package's name
    assert not names_torch(["pytorch-lightning-helpers\n", "torchmetrics"])
    assert not names_torch(["# nothing\n"])


def test_a_with_string_is_one_requirement_never_an_option_or_a_path() -> None:
    assert requirement_problem("gfdemo==1.0") is None
    assert "option" in (requirement_problem("--index-url=http://x") or "")
    assert requirement_problem("./local/pkg") is not None
    assert requirement_problem("a\nb") == "a requirement is one line"
    assert requirement_problem("   ") == "an empty requirement"


@pytest.mark.parametrize(
    "text",
    [
        "numpy",
        "Numpy[extra1, extra2] >= 2.0, < 3 ; python_version < '3.13'",
        "torch==2.5.1+cu124",
        "a (>=1,<2)",
        "b~=1.4.2",
    ],
)
def test_a_plain_requirement_passes(text: str) -> None:
    assert requirement_problem(text) is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("pkg @ https://host/x.whl", "URL"),
        ("pkg@ file:///etc/shadow", "URL"),
        ("pkg @ ./local", "direct reference"),
        ("git+https://host/repo.git", "URL"),
        ("/etc/shadow", "package name"),
        ("pkg.whl", "archive"),
        ("numpy==${HOME}", "variable"),
        ("numpy==1 --hash=sha256:ab", "not a plain requirement"),
    ],
)
def test_a_direct_reference_url_or_path_is_refused(text: str, said: str) -> None:
    assert said in (requirement_problem(text) or "")


def test_a_requirements_text_holds_requirements_and_hashes_only() -> None:
    good = (
        "# pinned\nnumpy==2.1.0 \\\n    --hash=sha256:ab12 \\\n    --hash=sha256:cd34\nscipy  # x\n"
    )
    assert requirements_text_problem(good) is None
    for text, said in [
        ("numpy\n-r /etc/shadow\n", "line 2: '-r'"),
        ("--index-url\thttp://x\n", "line 1: '--index-url'"),
        ("numpy\n\n--extra-index-url=http://x\n", "line 3: '--extra-index-url'"),
        ("-e .\n", "line 1: '-e'"),
        ("--no-index\n", "line 1"),
        ("a\nb\npkg @ https://x/y.whl\n", "line 3: 'pkg @ https://x/y.whl'"),
        ("--hash=sha256:ab\n", "line 1: --hash options follow no requirement"),
        ("numpy==1 \\\n  --hash=md5:ab\n", "line 1"),
    ]:
        assert (requirements_text_problem(text) or "").startswith(said), text


PROJECT_TOML = '[project]\nname = "p"\nversion = "1"\ndependencies = ["gfdemo>=1"]\n'


def test_a_project_asks_only_for_registry_packages() -> None:
    allowed = (
        PROJECT_TOML
        + '[project.optional-dependencies]\nfast = ["numba"]\n'
        + '[dependency-groups]\ndev = ["pytest", {include-group = "lint"}]\nlint = ["ruff"]\n'
        + '[tool.uv]\npackage = false\nconstraint-dependencies = ["numpy<3"]\n'
    )
    assert pyproject_problem(allowed) is None
    for extra, said in [
        ('[[tool.uv.index]]\nname = "x"\nurl = "http://x"\n', "tool.uv.index: not allowed"),
        ('[tool.uv.sources]\ngfdemo = { path = "/etc" }\n', "tool.uv.sources: not allowed"),
        ('[tool.uv]\nfind-links = ["/x"]\n', "tool.uv.find-links: not allowed"),
        ('[tool.uv]\ncache-dir = "/root"\n', "tool.uv.cache-dir: not allowed"),
        ('[tool.uv]\nindex-url = "http://x"\n', "tool.uv.index-url: not allowed"),
        (
            '[project.optional-dependencies]\nx = ["a @ https://x/a.whl"]\n',
            "project.optional-dependencies.x[0]:",
        ),
        ('[dependency-groups]\ndev = ["a", "git+https://x"]\n', "dependency-groups.dev[1]:"),
        ('[tool.uv]\ndev-dependencies = ["/etc/x"]\n', "tool.uv.dev-dependencies[0]:"),
    ]:
        assert (pyproject_problem(PROJECT_TOML + extra) or "").startswith(said), extra
    bad_dep = PROJECT_TOML.replace("gfdemo>=1", "gfdemo @ file:///etc/shadow")
    assert (pyproject_problem(bad_dep) or "").startswith("project.dependencies[0]:")
    assert (pyproject_problem("[project\n") or "").startswith("not valid TOML")


UV_LOCK = """version = 1
requires-python = ">=3.10"

[[package]]
name = "gfdemo"
version = "1.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "p"
version = "0.1"
source = { virtual = "." }
"""


def test_a_uv_lock_holds_registry_packages_and_the_project_only() -> None:
    assert uv_lock_problem(UV_LOCK) is None
    assert uv_lock_problem(UV_LOCK.replace("virtual", "editable")) is None
    for source, said in [
        ('{ git = "https://host/repo?rev=1#abc" }', "package 'gfdemo': source git"),
        ('{ url = "https://host/x.whl" }', "package 'gfdemo': source url"),
        ('{ path = "/etc/shadow" }', "package 'gfdemo': source path"),
        ('{ directory = "../x" }', "package 'gfdemo': source directory"),
        ('{ editable = "../x" }', "package 'gfdemo': source editable"),
    ]:
        text = UV_LOCK.replace('{ registry = "https://pypi.org/simple" }', source)
        assert (uv_lock_problem(text) or "").startswith(said), source
    sourceless = UV_LOCK.replace("source = { virtual", "x = { v")
    assert "not one registry" in (uv_lock_problem(sourceless) or "")
