"""docs/sharing.md's lab example is what the server and a worker accept: its sharing file
parses to the rules it describes, and its owner policy is a valid policy."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gpufleet.domain.owner import parse_policy
from gpufleet.domain.sharing import parse

DOC = Path(__file__).parents[2] / "docs" / "sharing.md"


def _lab_blocks() -> list[str]:
    text = DOC.read_text()
    lab = text.split("## A lab in 20 lines", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```toml\n(.*?)```", lab, re.S)


def test_the_lab_example_is_twenty_lines_of_toml_the_server_and_worker_accept() -> None:
    server, desktop = _lab_blocks()
    lines = [ln for ln in (server + desktop).splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) <= 20, len(lines)
    rules = parse(tomllib.loads(server), "sharing.toml")
    assert rules.fair_share and rules.half_life == 7 * 86400
    assert rules.user("alice").weight == 2 and rules.user("alice").max_gpus == 4
    assert rules.user("carol").weight == 1 and rules.user("carol").max_gpus is None
    assert rules.pool("default").preemptible and rules.pool("default").max_run == 3 * 86400
    assert rules.preemption.enabled and rules.preemption.min_priority == 10
    assert rules.preemption.min_wait == 600 and rules.preemption.protection == 7200
    assert rules.webhook_allow == ("hooks.slack.com",)
    policy = parse_policy(desktop, "owner.toml")
    assert policy.on_return == "vacate" and policy.delay == 30
