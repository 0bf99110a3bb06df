"""Where a webhook may be sent: a guard against turning the server on its own network.

A URL must be ``http`` or ``https``, with a host and no credentials in it
(:func:`check_url`). Each address its host resolves to (at creation, and again at every
delivery, so a name that changes to an inner address is caught) must pass
:meth:`Allowed.refusal`:

- refused always: the server's own listening ports on its own addresses (loopback, the
  address it binds, the addresses of its host name);
- refused unless the operator allows them by address or network: link-local addresses
  (169.254.0.0/16, fe80::/10) and cloud metadata endpoints (169.254.169.254,
  fd00:ec2::254; ``metadata.google.internal`` by name);
- refused unless allowed by address, network or host name: every address that is not
  global (loopback, private networks, unique-local, CGNAT, reserved, multicast).

An IPv6 address that carries an IPv4 one to a gateway (NAT64's ``64:ff9b::/96``, 6to4,
SIIT, IPv4-compatible) is judged as the IPv4 address it carries too.

The operator's allowlist is ``--webhook-allow`` (a comma list) and ``[webhooks] allow``
in the sharing file: host names, addresses or networks (``127.0.0.1``, ``10.0.0.0/8``,
``hooks.lab.internal``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata", "instance-data"})
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
#: IPv6 prefixes whose last 32 bits are an IPv4 address a gateway may reach for them:
#: NAT64's well-known and local-use prefixes, SIIT's IPv4-translated addresses, and
#: IPv4-compatible addresses (deprecated).
_IPV4_SUFFIX = (
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("64:ff9b:1::/48"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
    ipaddress.ip_network("::/96"),
)


class Refused(ValueError):
    """A destination the rules refuse; the message says why."""


@dataclass(frozen=True)
class Target:
    """A checked URL's parts: scheme, host (lower case), port, and the rest."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, never empty


def check_url(url: str) -> Target:
    """The parts of a webhook URL; :class:`Refused` for anything but http(s) with a host,
    and for credentials in it (they would be shown, logged and sent in the clear)."""
    if len(url) > 2000:
        raise Refused("longer than 2000 characters")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise Refused(f"not a URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise Refused("only http:// and https:// URLs are sent to")
    if parts.username is not None or parts.password is not None:
        raise Refused("no user name or password in the URL: put the secret in 'secret'")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise Refused("no host in the URL")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path)


def host_of(url: str) -> str:
    """The host alone, for lists and logs (never the path, where tokens live)."""
    try:
        return (urlsplit(url).hostname or "?").lower()
    except ValueError:
        return "?"


def literal(host: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def embedded(ip: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries to a gateway (NAT64, 6to4, Teredo, an
    IPv4-compatible address), judged as that address is; None for any other."""
    if not isinstance(ip, ipaddress.IPv6Address) or ip.is_unspecified or ip.is_loopback:
        return None
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if any(ip in net for net in _IPV4_SUFFIX):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


@dataclass(frozen=True)
class Allowed:
    """The operator's allowlist, and the server's own listening addresses and ports."""

    networks: tuple[Network, ...] = ()
    hosts: frozenset[str] = frozenset()
    own_ports: frozenset[int] = frozenset()
    own_addresses: frozenset[Address] = frozenset()

    @classmethod
    def of(
        cls,
        entries: Iterable[str],
        own_ports: Iterable[int] = (),
        own_addresses: Iterable[Address] = (),
    ) -> Allowed:
        """From allowlist entries (addresses, networks, host names); ValueError names a
        wrong one."""
        networks: list[Network] = []
        hosts: set[str] = set()
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not _is_host_name(entry):
                    raise ValueError(f"{entry!r} is not a host name, address or network") from None
                hosts.add(entry.lower().rstrip("."))
        return cls(
            tuple(networks), frozenset(hosts), frozenset(own_ports), frozenset(own_addresses)
        )

    def name_refusal(self, host: str) -> str | None:
        """Why a host name is refused before it is resolved (a metadata name), or None."""
        if host in METADATA_NAMES and host not in self.hosts:
            return f"{host} is a cloud metadata endpoint"
        return None

    def refusal(self, host: str, address: Address, port: int) -> str | None:
        """Why ``address`` (one that ``host`` resolved to) is refused at ``port``, or
        None when it may be sent to."""
        ip = literal(str(address)) or address
        if port in self.own_ports and self._own(ip):
            return f"{ip} port {port} is this server's own"
        if any(ip in net for net in self.networks):
            return None
        inner = embedded(ip)
        if inner is not None and (why := self.refusal(host, inner, port)) is not None:
            return f"{ip} carries {inner}: {why}"
        if ip in METADATA_ADDRESSES:
            return f"{ip} is a cloud metadata endpoint"
        if any(ip in net for net in _LINK_LOCAL):
            return f"{ip} is link-local"
        if ip.is_global or host in self.hosts:
            return None
        kind = "loopback" if ip.is_loopback else "not a public address"
        return f"{ip} is {kind}; the server's operator may allow it (--webhook-allow)"

    def _own(self, ip: Address) -> bool:
        return ip.is_loopback or ip.is_unspecified or ip in self.own_addresses


def _is_host_name(entry: str) -> bool:
    labels = entry.rstrip(".").split(".")
    return all(
        0 < len(label) <= 63 and all(c.isalnum() or c == "-" for c in label) for label in labels
    )
