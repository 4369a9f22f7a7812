"""The address a fellow tells the others, when it listens on every interface.

``join`` listens on ``0.0.0.0`` by default; fellows need an address they can reach.
``gethostbyname(gethostname())`` is not one: Debian, Ubuntu and Raspberry Pi OS map the
host name to 127.0.1.1. The rule instead asks the routing table, with a UDP socket that
is ``connect``ed (no packet is sent) and then says which local address it would send
from:

1. the address of the interface that routes to the first seed (a later seed when an
   earlier one has no route, or is this machine's loopback);
2. with no seeds, the one the default route leaves from, else the first non-loopback
   address of the machine;
3. a loopback address only when every seed is loopback (a swarm on one machine), or when
   the machine has no other address at all (said in the log).

The socket calls sit behind ``Routes`` so the rule is tested without a network.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import Protocol

from p2pswarm.config import split_addr

log = logging.getLogger("p2pswarm.agent")

# TEST-NET-1 (RFC 5737): never on a real network, but the default route covers it
DEFAULT_ROUTE_PROBE = ("192.0.2.1", 9)
WILDCARDS = ("0.0.0.0", "::", "")


class Routes(Protocol):
    def source_for(self, host: str, port: int) -> str | None:
        """The local address a datagram to ``host`` would leave from; None: no route
        (or the name does not resolve)."""

    def local_addresses(self) -> list[str]:
        """This machine's IPv4 addresses, in the order the system lists them."""


class SocketRoutes:
    """The real routing table, asked through sockets."""

    def source_for(self, host: str, port: int) -> str | None:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        except (OSError, UnicodeError):
            return None
        for family, kind, proto, _, target in infos:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.connect(target)  # sets the route; sends nothing
                    return str(probe.getsockname()[0])
            except OSError:
                continue
        return None

    def local_addresses(self) -> list[str]:
        try:
            import psutil

            return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET]
        except (ImportError, OSError):
            return []


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def advertised_host(seeds: Sequence[str], routes: Routes) -> str:
    """The host part to advertise for a wildcard listen (the rule above)."""
    sources = []
    for seed in seeds:
        host, port = split_addr(seed)
        source = routes.source_for(host, port)
        if source is not None and not is_loopback(source):
            return source
        sources.append(source)
    if sources and all(s is not None and is_loopback(s) for s in sources):
        return str(sources[0])  # every seed is this machine: a swarm on loopback
    default = routes.source_for(*DEFAULT_ROUTE_PROBE)
    if default is not None and not is_loopback(default):
        return default
    others = [a for a in routes.local_addresses() if not is_loopback(a)]
    if others:
        return others[0]
    log.warning("this machine has no address but loopback: fellows elsewhere cannot reach "
                "it (give --advertise HOST:PORT)")
    return "127.0.0.1"


def advertised(listen_addr: str, advertise: str | None, seeds: Sequence[str] = (),
               routes: Routes | None = None) -> str | None:
    """The address to tell fellows: ``advertise`` if given; for a wildcard listen, the
    rule's host with the bound port; otherwise None (the bound address itself)."""
    if advertise:
        return advertise
    host, port = split_addr(listen_addr)
    if host not in WILDCARDS:
        return None
    return f"{advertised_host(seeds, routes or SocketRoutes())}:{port}"


__all__ = ["Routes", "SocketRoutes", "advertised", "advertised_host", "is_loopback"]
