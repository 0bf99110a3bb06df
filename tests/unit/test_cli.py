"""The CLI without a server: configuration, capability, and errors before any request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app

runner = CliRunner()


def test_config_show_names_each_value_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpufleet.toml").write_text("heartbeat = 5.0\n[environments.lab]\nport = 9000\n")
    monkeypatch.setenv("GPUFLEET_ENV", "lab")
    monkeypatch.setenv("GPUFLEET_LEASE_TIMEOUT", "30")
    monkeypatch.setenv("GPUFLEET_TOKEN", "gf_secret")
    result = runner.invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["lease_timeout"]["value"] == "30.0"
    assert rows["lease_timeout"]["source"] == "env GPUFLEET_LEASE_TIMEOUT"
    assert rows["heartbeat"]["source"].startswith("file ")
    assert rows["port"]["value"] == "9000" and "[environments.lab]" in rows["port"]["source"]
    assert rows["retry_backoff"]["source"] == "default"
    assert rows["token"]["value"] == "****"
    assert "gf_secret" not in result.output


def test_capability_prints_simulated_gpus_as_json() -> None:
    result = runner.invoke(app, ["capability", "--simulate-gpus", "2xA100:80"])
    assert result.exit_code == 0, result.output
    cap = json.loads(result.output)
    assert cap["gpus_simulated"] is True
    assert [(g["name"], g["total_mib"]) for g in cap["gpus"]] == [("A100", 81920)] * 2
    assert cap["cores"] >= 1 and cap["ram_mib"] > 0


def test_bad_simulated_gpu_is_a_clear_error() -> None:
    result = runner.invoke(app, ["capability", "--simulate-gpus", "A100"])
    assert result.exit_code != 0
    assert 'item "A100" must look like NAME:VRAM_GIB' in str(result.exception)


def test_unreachable_server_names_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    result = runner.invoke(app, ["jobs", "--server", "http://127.0.0.1:9"])
    assert result.exit_code != 0
    assert "cannot reach the gpufleet server at http://127.0.0.1:9" in str(result.exception)


def test_out_of_range_flag_is_one_clear_line_not_a_traceback() -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "gpufleet", "submit", "--max-attempts", "500", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("error: invalid max_attempts:")
    assert "Traceback" not in res.stderr


def test_markup_in_a_job_name_is_printed_as_text() -> None:
    from gpufleet.cli.jobs import job_table
    from gpufleet.wire import JobOut

    job = JobOut.model_validate(
        {
            "id": "j-1",
            "name": "x[/y]",
            "status": "pending",
            "attempts": 0,
            "max_attempts": 3,
            "priority": 0,
            "worker": None,
            "worker_id": None,
            "gpus": [],
            "created_at": "2026-01-01T00:00:00Z",
            "started_at": None,
            "finished_at": None,
            "exit_code": None,
            "error": "[red]not markup[/red]",
        }
    )
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(job_table([job]))
    text = console.export_text()
    assert "x[/y]" in text and "[red]not markup[/red]" in text


def test_config_show_reports_the_token_a_local_server_saved() -> None:
    from gpufleet.config import save_token

    save_token("http://127.0.0.1:8000", "gf_saved_secret")
    result = runner.invoke(app, ["config", "show", "--json"])
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert rows["token"]["value"] == "****"
    assert "credentials.json" in rows["token"]["source"]
    assert "gf_saved_secret" not in result.output


def test_default_job_names_hold_no_slash() -> None:
    from gpufleet.cli.jobs import default_name

    assert default_name(["python", "scripts/train.py", "--out", "/data/runs/"]) == (
        "python train.py --out runs"
    )
