"""The address a fellow advertises when it listens on every interface: the routing rule
with the socket calls behind ``Routes``, and one real check on loopback."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from p2pswarm.agent.address import SocketRoutes, advertised, advertised_host


@dataclass
class TableRoutes:
    """A routing table: destination host -> the source address it leaves from."""

    table: dict[str, str] = field(default_factory=dict)
    default: str | None = "192.168.1.20"  # where the default route leaves from
    addresses: list[str] = field(default_factory=lambda: ["127.0.0.1", "192.168.1.20"])
    asked: list[str] = field(default_factory=list)

    def source_for(self, host: str, port: int) -> str | None:
        self.asked.append(host)
        if host == "192.0.2.1":
            return self.default
        return self.table.get(host)

    def local_addresses(self) -> list[str]:
        return list(self.addresses)


LAN = {"192.168.1.5": "192.168.1.20", "10.8.0.1": "10.8.0.7", "127.0.0.1": "127.0.0.1",
       "seed.lan": "192.168.1.20"}


@pytest.mark.parametrize("seeds, expected", [
    (["192.168.1.5:7946"], "192.168.1.20"),  # the interface that routes to the seed
    (["10.8.0.1:7946", "192.168.1.5:7946"], "10.8.0.7"),  # the first seed's (a VPN here)
    (["seed.lan:7946"], "192.168.1.20"),  # a seed by name
    (["127.0.0.1:7946"], "127.0.0.1"),  # every seed loopback: a swarm on one machine
    (["127.0.0.1:7946", "192.168.1.5:7946"], "192.168.1.20"),  # not every seed loopback
    (["nowhere:7946", "127.0.0.1:7946"], "192.168.1.20"),  # no route is not loopback
    (["nowhere:7946"], "192.168.1.20"),  # no route to the seed: the default route's
    ([], "192.168.1.20"),  # no seeds: the default route's
])
def test_the_routing_rule(seeds: list[str], expected: str) -> None:
    assert advertised_host(seeds, TableRoutes(dict(LAN))) == expected


def test_no_default_route_takes_the_first_address_that_is_not_loopback() -> None:
    routes = TableRoutes(dict(LAN), default=None,
                         addresses=["127.0.0.1", "127.0.1.1", "10.0.0.9", "192.168.1.20"])
    assert advertised_host([], routes) == "10.0.0.9"
    routes = TableRoutes(dict(LAN), default="127.0.0.1", addresses=["127.0.0.1", "10.0.0.9"])
    assert advertised_host([], routes) == "10.0.0.9"


def test_a_machine_with_only_loopback_says_so(caplog: pytest.LogCaptureFixture) -> None:
    routes = TableRoutes({}, default=None, addresses=["127.0.0.1"])
    assert advertised_host([], routes) == "127.0.0.1"
    assert "--advertise" in caplog.text


def test_advertised_keeps_the_port_and_respects_the_user() -> None:
    routes = TableRoutes(dict(LAN))
    assert advertised("0.0.0.0:7946", None, ["192.168.1.5:7946"], routes) == "192.168.1.20:7946"
    assert advertised("0.0.0.0:7946", "host.example:9000", [], routes) == "host.example:9000"
    assert advertised("10.0.0.9:7946", None, ["192.168.1.5:7946"], routes) is None  # bound
    assert routes.asked == ["192.168.1.5"]  # the user's address and a bound one ask nothing


def test_real_sockets_with_a_seed_on_loopback() -> None:
    assert advertised("0.0.0.0:7946", None, ["127.0.0.1:7946"], SocketRoutes()) == \
        "127.0.0.1:7946"
    # with no seed, never loopback when the machine has another address
    host = advertised_host([], SocketRoutes())
    others = [a for a in SocketRoutes().local_addresses() if not a.startswith("127.")]
    assert not host.startswith("127.") or not others


def test_status_shows_the_advertised_address_in_full(agent, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app

    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal
    addr = "[2001:db8:85a3::8a2e:370:7334]:7946"
    me = {"id": "ab" * 16, "name": "laptop-with-a-long-name", "addr": addr, "listen": "[::]:7946"}
    agent.answers["status"] = {
        "self": me, "preset": "lan", "health": 0, "leader": None, "leader_note": "none yet",
        "members": [{"id": me["id"], "name": me["name"], "addr": addr, "state": "alive",
                     "incarnation": 1, "cards": [], "last_heard_s": None, "self": True}],
        "counters": {}}
    result = CliRunner().invoke(app, ["status", "--home", str(tmp_path)],
                                env={"P2PSWARM_HOME": ""})
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert f"at {addr} (listening on [::]:7946)" in first
    # in the table, folded over lines if it must, never cut short
    lines = result.output.splitlines()
    header = next(line for line in lines if "address" in line)
    column = [c.strip() for c in header.split("┃")].index("address")
    cell = "".join(line.split("│")[column].strip() for line in lines if line.count("│") > 4)
    assert addr in cell
