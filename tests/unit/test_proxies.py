"""Which HTTP path a client takes for its calls and blob downloads: direct, unless a
proxy applies; and where a direct connection goes."""

from __future__ import annotations

import pytest

from gpufleet.client._direct import Direct, proxied

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture(autouse=True)
def _no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def test_no_proxy_settings_means_direct() -> None:
    assert not proxied("http://10.0.0.5:8000")


def test_a_proxy_for_the_scheme_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.lab:3128")
    assert proxied("http://10.0.0.5:8000")
    assert not proxied("https://fleet.lab")  # only plain http goes through that proxy
    monkeypatch.setenv("all_proxy", "http://proxy.lab:3128")
    assert proxied("https://fleet.lab")


def test_no_proxy_exempts_a_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.lab:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,.lab")
    assert not proxied("https://fleet.lab:8443")
    assert not proxied("https://localhost:8443")
    assert proxied("https://fleet.example.org")


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://[::1]", "::1", 80),
        ("https://[2001:db8::5]", "2001:db8::5", 443),
        ("http://[::1]:8000", "::1", 8000),
        ("http://fleet.lab", "fleet.lab", 80),
        ("https://fleet.lab:8443/gpufleet", "fleet.lab", 8443),
    ],
)
def test_a_server_without_a_port_is_called_on_its_schemes_port(
    url: str, host: str, port: int
) -> None:
    """(http.client, given no port, reads one off the end of an IPv6 address.)"""
    conn = Direct(url, {}, 5.0, None)._connect()
    assert (conn.host, conn.port) == (host, port)
