"""Webhook destinations: an IPv6 address that carries an IPv4 one to a gateway (NAT64,
6to4, SIIT, IPv4-compatible) is judged as the IPv4 address it carries."""

from __future__ import annotations

import ipaddress

import pytest

from gpufleet.domain.destinations import Allowed, embedded

OWN_PORT = 8000


@pytest.mark.parametrize(
    ("address", "carried", "why"),
    [
        ("64:ff9b::a9fe:a9fe", "169.254.169.254", "cloud metadata"),  # NAT64
        ("64:ff9b:1::a9fe:a9fe", "169.254.169.254", "cloud metadata"),  # NAT64, local use
        ("64:ff9b::a00:5", "10.0.0.5", "not a public address"),
        ("2002:a9fe:a9fe::1", "169.254.169.254", "cloud metadata"),  # 6to4
        ("2002:7f00:1::1", "127.0.0.1", "loopback"),
        ("::ffff:0:a9fe:a9fe", "169.254.169.254", "cloud metadata"),  # SIIT
        ("::a9fe:a9fe", "169.254.169.254", "cloud metadata"),  # IPv4-compatible
    ],
)
def test_an_ipv6_address_carrying_a_refused_ipv4_one_is_refused(
    address: str, carried: str, why: str
) -> None:
    ip = ipaddress.IPv6Address(address)
    assert embedded(ip) == ipaddress.IPv4Address(carried)
    refused = Allowed.of([]).refusal("hooks.example.com", ip, 443)
    assert refused is not None and carried in refused and why in refused


def test_the_servers_own_port_is_refused_through_nat64_even_where_loopback_is_allowed() -> None:
    allowed = Allowed.of(["127.0.0.1"], own_ports=[OWN_PORT])
    ip = ipaddress.IPv6Address("64:ff9b::7f00:1")
    refused = allowed.refusal("x", ip, OWN_PORT)
    assert refused is not None and "this server's own" in refused
    assert allowed.refusal("x", ip, OWN_PORT + 1) is None  # loopback, allowed, another port


def test_a_public_ipv4_address_through_nat64_and_plain_ipv6_ones_are_allowed() -> None:
    allowed = Allowed.of([])
    assert allowed.refusal("x", ipaddress.IPv6Address("64:ff9b::808:808"), 443) is None
    assert allowed.refusal("x", ipaddress.IPv6Address("2606:4700::1111"), 443) is None
    assert embedded(ipaddress.IPv6Address("2606:4700::1111")) is None
    assert embedded(ipaddress.IPv6Address("::1")) is None
