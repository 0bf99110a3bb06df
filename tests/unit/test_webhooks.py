"""Webhooks, the pure parts: which status change is which event, the body, the signature
a receiver checks, the retry schedule, and the destinations refused."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import replace

import pytest

from gpufleet.client import verify_webhook
from gpufleet.domain import webhooks as w
from gpufleet.domain.destinations import Allowed, Refused, check_url, host_of

FACTS = w.JobFacts("j-1", "train <b>", "alice", "gpu", "failed", 2, "exit", "exit code 3")


@pytest.mark.parametrize(
    ("status", "cause", "event"),
    [
        ("succeeded", None, "succeeded"),
        ("failed", "exit", "failed"),
        ("cancelled", None, "cancelled"),
        ("pending", "preempted", "preempted"),
        ("pending", "drained", None),
        ("pending", "lost", None),
        ("pending", "exit", None),  # a retry: the job is not over
        ("running", None, None),
    ],
)
def test_which_status_change_is_which_event(status: str, cause: str | None, event: str) -> None:
    assert w.event_of(status, cause) == event


def test_the_body_is_slack_text_plus_the_facts() -> None:
    data = json.loads(w.body("failed", FACTS, 100.0))
    assert data["text"].startswith(
        "gpufleet job train &lt;b&gt; (j-1) of alice failed: exit code 3"
    )
    assert data["gpufleet"]["name"] == "train <b>"  # the facts as they are
    assert data["gpufleet"]["event"] == "failed"
    assert data["gpufleet"]["attempt"] == 2 and data["gpufleet"]["cause"] == "exit"
    late = json.loads(w.body("running_past", FACTS, 100.0, running_past=7200))
    assert "more than 2h" in late["text"]


def test_a_receiver_verifies_with_hashlib_and_hmac_alone() -> None:
    body = w.body("succeeded", FACTS, 100.0)
    header = w.signature("s3cret", 1_700_000_000, body)
    t, v1 = (p.split("=", 1)[1] for p in header.split(","))
    mine = hmac.new(b"s3cret", f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(mine, v1)
    headers = {"x-gpufleet-signature": header}
    assert verify_webhook("s3cret", headers, body, now=1_700_000_100)
    assert not verify_webhook("s3cret", headers, body + b"x", now=1_700_000_100)
    assert not verify_webhook("other", headers, body, now=1_700_000_100)
    assert not verify_webhook("s3cret", headers, body, now=1_700_000_000 + 301)  # a replay
    assert not verify_webhook("s3cret", {}, body, now=1_700_000_000)
    assert not verify_webhook("s3cret", {"X-Gpufleet-Signature": "t=x,v1=00"}, body, now=0)


def test_retries_double_with_jitter_and_stop_after_five_tries() -> None:
    lows = [w.delay(n, 0.0) for n in range(1, w.TRIES)]
    highs = [w.delay(n, 0.999) for n in range(1, w.TRIES)]
    assert lows == [2.0, 4.0, 8.0, 16.0]
    assert all(h is not None and h < 6 * 2**i for i, h in enumerate(highs))
    assert w.delay(w.TRIES, 0.5) is None
    assert 30 <= sum(w.delay(n, 0.5) or 0 for n in range(1, w.TRIES)) <= 90  # about a minute


def test_unknown_events_are_named() -> None:
    assert w.parse_events([]) == w.DEFAULT_EVENTS
    with pytest.raises(ValueError, match="'done'"):
        w.parse_events(["done"])


@pytest.mark.parametrize(
    "url",
    ["ftp://x.org/", "javascript:alert(1)", "http://u:p@x.org/", "http://u@x.org/", "https:///"],
)
def test_urls_refused_as_written(url: str) -> None:
    with pytest.raises(Refused):
        check_url(url)


def test_a_url_is_shown_by_its_host_alone() -> None:
    assert host_of("https://hooks.slack.com/services/T0/B0/XYZ") == "hooks.slack.com"
    t = check_url("https://Hooks.Example.org./a?b=1")
    assert (t.host, t.port, t.path) == ("hooks.example.org", 443, "/a?b=1")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_addresses_refused_and_allowed() -> None:
    none = Allowed.of([], own_ports=[8000], own_addresses=[_ip("10.0.0.5")])
    assert none.refusal("x", _ip("93.184.215.14"), 443) is None
    for bad in ("127.0.0.1", "10.1.1.1", "192.168.1.1", "::1", "fc00::1", "100.64.0.1"):
        assert none.refusal("x", _ip(bad), 80) is not None, bad
    assert "link-local" in (none.refusal("x", _ip("169.254.3.4"), 80) or "")
    assert "metadata" in (none.refusal("x", _ip("169.254.169.254"), 80) or "")
    assert "metadata" in (none.refusal("x", _ip("::ffff:169.254.169.254"), 80) or "")
    assert "loopback" in (none.refusal("x", _ip("::ffff:127.0.0.1"), 80) or "")
    assert none.name_refusal("metadata.google.internal") is not None
    lab = Allowed.of(["127.0.0.1", "10.0.0.0/8", "hooks.lab"], [8000], [_ip("10.0.0.5")])
    assert lab.refusal("x", _ip("127.0.0.1"), 9000) is None
    assert lab.refusal("x", _ip("10.9.9.9"), 80) is None
    assert lab.refusal("hooks.lab", _ip("192.168.3.3"), 80) is None  # allowed by name
    assert "own" in (lab.refusal("x", _ip("127.0.0.1"), 8000) or "")  # never its own port
    assert "own" in (lab.refusal("x", _ip("10.0.0.5"), 8000) or "")
    assert lab.refusal("hooks.lab", _ip("169.254.169.254"), 80) is not None  # a name: no
    with pytest.raises(ValueError, match="not a host name"):
        Allowed.of(["not a host!"])


def test_a_job_name_cannot_ping_a_channel_or_hide_a_link_in_chat() -> None:
    # Slack reads <!channel>, <@U123> and <url|text> in ``text``: a submitter's job name
    # (or error) must not page an operator's pool channel or show a link as other text.
    sly = replace(
        FACTS,
        name="<!channel> x <https://evil.example|dashboard>",
        error="see <@U123> & co",
    )
    data = json.loads(w.body("failed", sly, 100.0))
    assert "<" not in data["text"] and ">" not in data["text"]
    assert "&lt;!channel&gt;" in data["text"] and "&lt;@U123&gt; &amp; co" in data["text"]
    assert data["gpufleet"]["name"] == sly.name and data["gpufleet"]["error"] == sly.error
