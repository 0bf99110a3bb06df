"""A job's environment spec: its keys name the same request the same way everywhere, and
a worker's torch build follows its GPUs and driver (gpufleet.domain.environments)."""

from __future__ import annotations

from gpufleet.domain.environments import (
    EnvFile,
    EnvKind,
    EnvSpec,
    build_key,
    lock_key,
    names_torch,
    normalize_requirement,
    requirement_problem,
    torch_backend_for,
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
