"""Failures say why while they happen: each failed attempt as it ends, exit codes a job
names as not retried, and hyper.* keys its script does not take, refused at apply."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import Fleet

FAILS_4 = "import sys; print('it broke: no such file data.csv', file=sys.stderr); sys.exit(4)"


def test_submit_wait_says_how_each_attempt_failed_and_when_it_is_retried(fleet: Fleet) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    res = fleet.cli("submit", "--wait", "--", "python", "-c", FAILS_4, check=False)
    assert res.returncode == 1, res.stderr
    said = res.stderr.splitlines()
    print(res.stderr)
    heads = [line for line in said if line.startswith("attempt ")]
    assert [h.split(":")[0] for h in heads] == [
        "attempt 1/3 failed",
        "attempt 2/3 failed",
        "attempt 3/3 failed",
    ], res.stderr
    assert all("exit code 4" in h for h in heads)
    assert all("retry at " in h for h in heads[:2]) and "no attempts left" in heads[2]
    # each attempt's notice is followed by the last line it wrote to stderr
    for head in heads:
        after = said[said.index(head) + 1]
        assert after == "  stderr: it broke: no such file data.csv", res.stderr


def test_an_exit_code_named_as_not_retried_fails_the_job_after_one_attempt(
    fleet: Fleet,
) -> None:
    fleet.start_server()
    fleet.start_worker("w1")
    res = fleet.cli(
        "submit", "--wait", "--no-retry-on", "4,5", "--", "python", "-c", FAILS_4, check=False
    )
    assert res.returncode == 1, res.stderr
    heads = [line for line in res.stderr.splitlines() if line.startswith("attempt ")]
    print(res.stderr)
    assert len(heads) == 1 and heads[0].startswith("attempt 1/3 failed: exit code 4"), heads
    assert "never retried" in heads[0] and "retry at" not in res.stderr
    job_id = res.stdout.strip().splitlines()[-1]
    shown = fleet.job(job_id)
    assert (shown["status"], shown["attempts"], len(shown["history"])) == ("failed", 1, 1)
    assert shown["spec"]["no_retry_on"] == [4, 5]


TRAIN = """\
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=1)
print(parser.parse_args())
"""

PLAN = """\
schema_version = 1
name = "drift"

[defaults]
command = "python train.py"
packages = ["."]

[[jobs]]
name = "fits"
hyper.epochs = 2

[[jobs]]
name = "drifted"
hyper.{key} = 32
"""


def test_apply_refuses_a_hyper_key_the_script_does_not_take_and_writes_nothing(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(TRAIN)
    plan = proj / "plan.toml"
    plan.write_text(PLAN.format(key="batchsize"))
    res = fleet.cli("apply", str(plan), check=False)
    assert res.returncode != 0
    print(res.stderr)
    assert '"hyper.batchsize"' in res.stderr and "did you mean --batch-size?" in res.stderr
    with fleet.client() as c:
        assert c.jobs() == []
    blobs = fleet.root / "data" / "blobs"
    assert [p for p in blobs.rglob("*") if p.is_file()] == []  # the package not uploaded
    plan.write_text(PLAN.format(key="batch_size"))  # the key the script takes
    done = json.loads(fleet.cli("apply", str(plan), "--json").stdout)
    assert len(done["created"]) == 2


def test_apply_says_in_one_line_when_it_cannot_read_a_scripts_options(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("import argparse, not_installed_here\n" + TRAIN)
    plan = proj / "plan.toml"
    plan.write_text(PLAN.format(key="batchsize"))
    res = fleet.cli("apply", str(plan))
    print(res.stderr)
    notes = [line for line in res.stderr.splitlines() if "not checked" in line]
    assert len(notes) == 1 and "not_installed_here" in notes[0], res.stderr


DUMPS_ENV = "import json, os\njson.dump(dict(os.environ), open('env.json', 'w'))\n"


def test_apply_reads_the_script_in_the_jobs_package_without_the_callers_secrets(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_server()
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text(DUMPS_ENV + TRAIN)
    plan = proj / "plan.toml"
    text = PLAN.replace('packages = ["."]', 'packages = ["src"]')
    plan.write_text(text.format(key="batchsize"))
    secrets = {"GPUFLEET_TOKEN": "gft-e2e-secret", "AWS_SECRET_ACCESS_KEY": "aws-e2e-secret"}
    res = fleet.cli("apply", str(plan), check=False, env=secrets)
    assert res.returncode != 0 and "did you mean --batch-size?" in res.stderr, res.stderr
    seen = json.loads((proj / "src" / "env.json").read_text())
    assert not set(secrets.values()) & set(seen.values())
    plan.write_text(text.format(key="batch"))  # argparse takes --batch for --batch-size
    done = json.loads(fleet.cli("apply", str(plan), "--json").stdout)
    assert len(done["created"]) == 2
