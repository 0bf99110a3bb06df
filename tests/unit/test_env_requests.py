"""A job's environment as a user names it: requirements files read and checked before
anything is sent, the manifest's keys, and the API's limits."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gpufleet.cli.environments import _spec_files, requirements_text, spec_hint
from gpufleet.domain.environments import EnvFile, EnvRequest, EnvSpec
from gpufleet.domain.manifest import parse_manifest
from gpufleet.errors import ConfigError, ManifestError
from gpufleet.wire import JobSpecModel


def test_includes_are_inlined_and_the_text_is_normalized(tmp_path: Path) -> None:
    (tmp_path / "base.txt").write_text("numpy>=2  # arrays\n\n# comment\nscipy\n")
    (tmp_path / "requirements.txt").write_text("-r base.txt\nscikit-learn==1.9.1\nnumpy>=2\n")
    assert requirements_text(tmp_path / "requirements.txt") == (
        "numpy>=2\nscikit-learn==1.9.1\nscipy\n"
    )


def test_two_files_that_ask_the_same_travel_as_one(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("b==1\na==2\n")
    (tmp_path / "b.txt").write_text("# same\na==2\n\nb==1\n")
    assert requirements_text(tmp_path / "a.txt") == requirements_text(tmp_path / "b.txt")


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("-e ./mypkg", "editable"),
        ("--index-url https://example.org/simple", "chooses the index"),
        ("-i https://example.org/simple", "chooses the index"),
        ("--find-links /wheels", "where wheels come from"),
        ("./local/pkg", "local path"),
        ("-c constraints.txt", "constraints"),
        ("--index-url\thttp://x", "chooses the index"),  # a tab is a space too
        ("--trusted-host x", "options are not sent"),
        ("pkg @ https://host/x.whl", "URL"),
        ("pkg@file:///etc/passwd", "URL"),
        ("git+https://host/repo", "URL"),
        ("gfdemo-1.0-py3-none-any.whl", "archive"),
    ],
)
def test_what_cannot_travel_is_refused_naming_file_and_line(
    tmp_path: Path, line: str, said: str
) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text(f"numpy\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        requirements_text(req)
    assert f"{req}:2" in caught.value.message
    assert said in caught.value.message


def test_an_include_loop_and_a_missing_include_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("-r b.txt\n")
    (tmp_path / "b.txt").write_text("-r a.txt\n")
    with pytest.raises(ConfigError, match="includes itself"):
        requirements_text(tmp_path / "a.txt")
    (tmp_path / "c.txt").write_text("-r missing.txt\n")
    with pytest.raises(ConfigError, match=r"missing\.txt: cannot read it"):
        requirements_text(tmp_path / "c.txt")


def test_a_package_folder_with_a_spec_gets_a_hint(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    assert spec_hint([str(tmp_path / "proj")]) is None
    (tmp_path / "proj" / "uv.lock").write_text("")
    hint = spec_hint([f"code={tmp_path / 'proj'}"])
    assert hint is not None
    assert "holds uv.lock" in hint
    assert f"--with-requirements {tmp_path / 'proj' / 'pyproject.toml'}" in hint


MANIFEST = """\
schema_version = 1
name = "envs"
[defaults]
command = "python train.py"
with_requirements = "requirements.txt"
python = "3.11"
[[jobs]]
name = "a"
[[jobs]]
name = "b"
with = ["numpy>=2", "scipy"]
upgrade = true
"""


def test_the_manifest_takes_the_environment_in_defaults_and_per_job() -> None:
    plan = parse_manifest(MANIFEST, "envs.toml")
    a, b = plan.jobs
    assert a.environment == EnvRequest("requirements.txt", (), "3.11", False)
    assert b.environment == EnvRequest("requirements.txt", ("numpy>=2", "scipy"), "3.11", True)


@pytest.mark.parametrize(
    ("line", "field", "said"),
    [
        ('python = "2.7"', "python", "not a Python version"),
        ('with = ["--index-url x"]', "with[0]", "is an option"),
        ("with = 3", "with", "expected"),
    ],
)
def test_a_bad_environment_key_names_the_job_and_field(line: str, field: str, said: str) -> None:
    text = MANIFEST.replace('name = "a"', f'name = "a"\n{line}')
    with pytest.raises(ManifestError) as caught:
        parse_manifest(text, "envs.toml")
    assert "envs.toml" in str(caught.value)
    assert field in str(caught.value)
    assert said in str(caught.value)


SHA = "a" * 64


def _spec(environment: dict[str, object]) -> JobSpecModel:
    return JobSpecModel.model_validate(
        {"name": "j", "command": ["python"], "environment": environment}
    )


def test_the_api_takes_an_environment_and_keys_it_by_what_was_asked() -> None:
    one = _spec({"with": ["Numpy >= 2", "scipy"], "python": "3.11"}).to_domain().environment
    two = _spec({"with": ["scipy", "numpy>=2"], "python": "3.11"}).to_domain().environment
    other = _spec({"with": ["numpy>=2"], "python": "3.12"}).to_domain().environment
    assert isinstance(one, EnvSpec) and isinstance(two, EnvSpec) and isinstance(other, EnvSpec)
    assert one.key() == two.key() != other.key()
    upgraded = _spec({"with": ["scipy", "numpy>=2"], "python": "3.11", "upgrade": True})
    assert isinstance(up := upgraded.to_domain().environment, EnvSpec)
    assert up.key() == one.key()  # a fresh resolution is the same spec


@pytest.mark.parametrize(
    ("environment", "said"),
    [
        ({}, "names a requirements.txt"),
        ({"lock": {"name": "uv.lock", "sha256": SHA, "size": 1}}, "comes with its pyproject"),
        (
            {
                "project": {"name": "pyproject.toml", "sha256": SHA, "size": 1},
                "with": ["numpy"],
            },
            "add it to the pyproject",
        ),
        ({"with": ["numpy"], "python": "3.11; rm -rf /"}, "python"),
        ({"with": ["numpy\nscipy"]}, "one line"),
        ({"requirements": {"name": "../r.txt", "sha256": SHA, "size": 1}}, "name"),
        ({"project": {"name": "p.toml", "sha256": SHA, "size": 1}}, "must be pyproject.toml"),
        (
            {
                "project": {"name": "pyproject.toml", "sha256": SHA, "size": 1},
                "lock": {"name": "pylock.toml", "sha256": SHA, "size": 1},
            },
            "must be uv.lock",
        ),
        ({"with": ["pkg @ https://host/x.whl"]}, "URL"),
    ],
)
def test_the_api_refuses_an_environment_that_cannot_be_built(
    environment: dict[str, object], said: str
) -> None:
    with pytest.raises(ValidationError, match=said):
        _spec(environment)


def test_the_spec_says_what_it_is_built_from() -> None:
    spec = EnvSpec(
        project=EnvFile("pyproject.toml", SHA, 10), lock=EnvFile("uv.lock", SHA, 20), python="3.12"
    )
    assert spec.describe() == "pyproject.toml + uv.lock, --python 3.12"
    assert spec.locked


def test_a_hash_pinned_requirement_stays_whole(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text(
        "# via pip-compile --generate-hashes\n"
        "numpy==2.1.0 \\\n"
        "    --hash=sha256:aaa \\\n"
        "    --hash=sha256:bbb\n"
        "scipy==1.14.0 \\\n"
        "    --hash=sha256:ccc\n"
    )
    assert requirements_text(req) == (
        "numpy==2.1.0 --hash=sha256:aaa --hash=sha256:bbb\nscipy==1.14.0 --hash=sha256:ccc\n"
    )


def test_a_project_with_uv_sources_is_refused_naming_the_file(tmp_path: Path) -> None:
    project = tmp_path / "pyproject.toml"
    project.write_text(
        '[project]\nname = "p"\nversion = "1"\ndependencies = ["gfdemo"]\n'
        '[tool.uv.sources]\ngfdemo = { git = "https://host/repo" }\n'
    )
    with pytest.raises(ConfigError) as caught:
        _spec_files(None, project)  # type: ignore[arg-type]  # refused before any upload
    assert f"{project}: tool.uv.sources: not allowed" in caught.value.message
