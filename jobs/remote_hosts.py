"""Which addresses a remote image may come from: public ones, plus the hosts and networks the user allowed
(`--allow-remote-hosts`). Pure logic (ipaddress only); jobs/fetch.py applies it to every resolved address.

Refused unless allowed: loopback, private (RFC 1918, fc00::/7), shared (100.64/10), link-local, multicast,
reserved, unspecified and documentation addresses, in IPv4 and IPv6, and IPv6 forms that carry an IPv4 address
(IPv4-mapped ::ffff:a.b.c.d, 6to4 2002::/16, NAT64 64:ff9b::/96) are judged by that address too.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


@dataclass(frozen=True)
class RemoteHosts:
    """Host names (lowercase, no trailing dot) and networks whose addresses remote images may reach anyway."""

    names: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, specs: tuple[str, ...] | list[str]) -> RemoteHosts:
        """From `--allow-remote-hosts` values: a host name, an IP address or a CIDR network each. ValueError if bad."""
        names: set[str] = set()
        networks: list[IPNetwork] = []
        for spec in specs:
            value = spec.strip().strip("[]").lower()
            try:
                networks.append(ipaddress.ip_network(value, strict=False))
                continue
            except ValueError:
                pass
            name = value.rstrip(".")
            if not _HOST_NAME.match(name):
                raise ValueError(f"--allow-remote-hosts {spec!r}: give a host name, an IP address or a CIDR network")
            names.add(name)
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str, address: IPAddress) -> bool:
        """Whether an image from `host`, resolved to `address`, may be fetched."""
        if host.lower().rstrip(".") in self.names:
            return True
        forms = _forms(address)
        if any(a in net for net in self.networks for a in forms if a.version == net.version):
            return True
        return all(is_public(a) for a in forms)


def is_public(address: IPAddress) -> bool:
    """A globally routable unicast address (judged alone; see RemoteHosts.allows for embedded IPv4)."""
    return address.is_global and not (
        address.is_multicast
        or address.is_reserved
        or address.is_loopback
        or address.is_link_local
        or address.is_unspecified
        or address.is_private
    )


def literal_address(host: str) -> IPAddress | None:
    """The address a URL's host names literally (`10.0.0.1`, `[::1]`), or None for a name to resolve."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _forms(address: IPAddress) -> list[IPAddress]:
    """The address, and the IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), if any."""
    forms: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            forms.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            forms.append(address.sixtofour)
        if address in _NAT64:
            forms.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return forms
