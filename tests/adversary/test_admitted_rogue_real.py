"""An admitted rogue against real `p2pswarm join` processes.

Three honest fellows run from an admin's home; a fourth joins with the same invitation and
is admitted (it holds a valid certificate), is killed, and its home is taken over by an
in-process agent that never runs for leader (``Bystander``) and says what it likes, sealed
with the swarm key and signed with its own identity. In turn it claims a leader priority
above its certificate's cap, says the leader left (unsigned, then signed with its own
key), syncs 1,500 made-up self-signed members without certificates, and floods thousands
of records whose certificates and signatures are forged. After each: every honest fellow
still follows the same honest leader, no made-up member is in any view or in
``election.json``, and the refusal is counted in ``status``. At the end the leader is
killed with SIGKILL and a new honest leader is elected within a deadline: the made-up
members do not pin anyone's health.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.admission import AdmissionSetup
from p2pswarm.agent.votes import VOTES_FILE
from p2pswarm.agent.world import AgentWorld
from p2pswarm.config import local
from p2pswarm.home import Home
from p2pswarm.membership.proofs import alive_signed_bytes, left_signed_bytes
from p2pswarm.security import Identity
from p2pswarm.security.admission import Certificate
from p2pswarm.security.identity import node_id_of
from p2pswarm.sim import commands
from p2pswarm.sim.commands import cli, poll, present, status_of, stop
from p2pswarm.sim.field import free_port
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport
from p2pswarm.wire import gossip as g
from tests.adversary.rogue import Bystander

pytestmark = pytest.mark.slow  # real processes

HONEST = ("admin", "a", "b")
I32_MAX = 2**31 - 1
GHOSTS = 1500
FLOOD = 4000  # records with forged certificates and signatures, in messages of 1,000


def join(home: Path, port: int, *args: str) -> subprocess.Popen[str]:
    return commands.join(home, *args, listen=f"127.0.0.1:{port}", output=subprocess.DEVNULL)


def leader_id(doc: dict[str, Any] | None) -> str | None:
    return None if doc is None or doc["leader"] is None else str(doc["leader"]["id"])


async def await_until(what: str, ready: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """``poll`` for the trio part: the condition (which asks agents over their control
    sockets) runs in a thread, so the rogue's agent keeps running meanwhile."""
    began = time.monotonic()
    while not await trio.to_thread.run_sync(ready):
        assert time.monotonic() - began < timeout_s, f"gave up waiting for {what}"
        await trio.sleep(0.1)
    return time.monotonic() - began


def ghost_records(count: int) -> list[g.MemberRecord]:
    """Made-up fellows, each signing its own Alive, none with a certificate."""
    out = []
    for i in range(count):
        key = Identity.generate()
        name, addr = f"ghost{i}", f"10.9.{i // 250}.{i % 250 + 1}:7946"
        sig = key.sign(alive_signed_bytes(key.node_id, 1, name, addr, key.public_key, 0, 255, 0))
        out.append(g.MemberRecord(key.node_id, 1, g.STATE_ALIVE, name, addr, key.public_key,
                                  255, 0, b"", None, 0, 0, sig, b""))
    return out


def forged_records(count: int, template: Certificate) -> list[g.MemberRecord]:
    """Made-up fellows whose certificates (the rogue's own, rebound) and Alive signatures
    are random bytes: each costs a victim a signature check, if it lets it."""
    out = []
    for i in range(count):
        public_key = os.urandom(32)
        node, name = node_id_of(public_key), f"forged{i}"
        cert = dataclasses.replace(template, public_key=public_key, name=name,
                                   signature=os.urandom(64)).encode()
        out.append(g.MemberRecord(node, 1, g.STATE_ALIVE, name, f"10.8.0.1:{1000 + i}",
                                  public_key, 0, 0, b"", None, 0, 0, os.urandom(64), cert))
    return out


class Swarm:
    """The honest fellows' homes and processes; what their status says."""

    def __init__(self, homes: dict[str, Path], procs: dict[str, subprocess.Popen[str]]) -> None:
        self.homes = homes
        self.procs = procs
        self.real: set[str] = set()  # the four fellows' ids, once known

    def docs(self, names: tuple[str, ...] = HONEST) -> dict[str, dict[str, Any] | None]:
        return {n: status_of(self.homes[n]) for n in names}

    def led_by(self, leader: str, names: tuple[str, ...] = HONEST) -> bool:
        return all(leader_id(d) == leader for d in self.docs(names).values())

    def counted(self, counter: str) -> dict[str, int]:
        out = {}
        for name, doc in self.docs().items():
            assert doc is not None, f"{name} does not answer"
            out[name] = int(doc["membership"].get(counter, 0))
        return out

    def assert_unharmed(self, leader: str, made_up: set[str]) -> None:
        """Every honest fellow alive, following ``leader``, and no made-up member in any
        view or kept vote record."""
        for name, doc in self.docs().items():
            assert self.procs[name].poll() is None, f"{name} exited"
            assert doc is not None, f"{name} does not answer"
            assert leader_id(doc) == leader, (name, doc["leader"])
            names = {m["name"] for m in doc["members"]}
            assert not names & made_up, (name, sorted(names & made_up)[:5])
            assert {m["id"] for m in doc["members"]} <= self.real, name
            votes = self.homes[name] / VOTES_FILE
            if votes.exists():
                kept = json.loads(votes.read_text())
                assert set(kept["electorate"]) <= self.real, (name, kept)
            # the made-up members' silence does not count against health (it pins at 7)
            assert doc["health"] < 7, (name, doc["health"])


def rss_mib(process: subprocess.Popen[str]) -> float:
    """A victim's resident memory now (MiB), from /proc."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Costs:
    """What each attack cost the victims: new loop stalls over 100 ms, and RSS growth
    (printed as the figures; the assertions stay on what cannot flake)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.rows: list[str] = []
        self._mark()

    def _mark(self) -> None:
        docs = self.swarm.docs()
        self.stalls = {n: d["loop_lag"]["over_0_1_s"] for n, d in docs.items() if d}
        self.rss = {n: rss_mib(self.swarm.procs[n]) for n in self.stalls}

    def after(self, attack: str) -> None:
        stalls, rss = dict(self.stalls), dict(self.rss)
        self._mark()
        new = max(self.stalls[n] - stalls.get(n, 0) for n in self.stalls)
        grown = max(self.rss[n] - rss.get(n, 0.0) for n in self.rss)
        self.rows.append(f"{attack}: new loop stalls over 100 ms {new}, "
                         f"most RSS growth {grown:+.1f} MiB")


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {n: after[n] - before[n] for n in after}


def test_an_admitted_rogue_cannot_take_or_stall_the_leadership(tmp_path: Path) -> None:
    homes = {n: tmp_path / n for n in (*HONEST, "rogue")}
    assert cli("init", "--home", str(homes["admin"])).returncode == 0
    invited = cli("invite", "--home", str(homes["admin"]), "--uses", "3", "--json")
    assert invited.returncode == 0, invited.stderr
    token = json.loads(invited.stdout)["token"]
    ports = {n: free_port() for n in homes}
    seed = f"127.0.0.1:{ports['admin']}"
    procs: dict[str, subprocess.Popen[str]] = {}
    swarm = Swarm(homes, procs)
    try:
        procs["admin"] = join(homes["admin"], ports["admin"], "--name", "admin")
        poll("the admin's fellow", lambda: "admin" in present(status_of(homes["admin"])))
        for n in ("a", "b"):
            procs[n] = join(homes[n], ports[n], seed, "--name", n, "--token", token)
        poll("one honest leader", lambda: all(
            present(d) == set(HONEST) for d in swarm.docs().values())
            and len({leader_id(d) for d in swarm.docs().values()} - {None}) == 1
            and None not in {leader_id(d) for d in swarm.docs().values()})
        # the rogue is admitted like any fellow, then its home is taken over in-process
        procs["rogue"] = join(homes["rogue"], ports["rogue"], seed, "--name", "rogue",
                              "--token", token)
        poll("the rogue admitted", lambda: all(
            "rogue" in present(d) for d in swarm.docs().values()))
        procs["rogue"].kill()
        procs.pop("rogue").wait(10)
        leader = leader_id(status_of(homes["admin"]))
        assert leader is not None
        trio.run(attack, swarm, homes["rogue"], ports["rogue"], leader, seed)
    finally:
        stop(*procs.values(), timeout_s=15)


async def attack(swarm: Swarm, rogue_home: Path, port: int, leader: str, seed: str) -> None:
    setup = AdmissionSetup.of_home(rogue_home)
    assert setup is not None and setup.certificate
    certificate = Certificate.decode(setup.certificate)
    home = Home(rogue_home)
    async with open_udp_tcp_transport(f"127.0.0.1:{port}", local().transport) as transport:
        agent = Agent(AgentWorld(
            name="rogue", transport=transport, keyring=home.load_keyring(),
            identity=home.load_identity(), config=local(), epoch=time.time_ns() // 1000,
            rng=random.Random(), seeds=(seed,), home=rogue_home,
            advertise=f"127.0.0.1:{port}", election=Bystander, admission=setup))
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)
            await await_until("the rogue back", lambda: all(
                "rogue" in present(d) for d in swarm.docs().values()))
            assert swarm.led_by(leader)
            lag_before = {n: d["loop_lag"]["over_1_s"] for n, d in swarm.docs().items()
                          if d is not None}
            victims = {n: d["self"]["addr"] for n, d in swarm.docs().items()
                       if d is not None}
            assert len(victims) == 3
            swarm.real = {d["self"]["id"] for d in swarm.docs().values() if d is not None}
            swarm.real.add(agent.node_id.hex())
            leader_name = next(n for n, d in swarm.docs().items()
                               if d is not None and d["self"]["id"] == leader)
            made_up: set[str] = set()
            costs = Costs(swarm)

            # 1. leader priority 2^31-1, signed by the rogue, above its certificate's cap
            before = swarm.counted("priority_beyond_certificate")
            m = agent.membership
            assert m is not None
            fields = dict(node=agent.node_id, incarnation=m.incarnation + 1, name="rogue",
                          addr=agent.addr, public_key=agent.identity.public_key,
                          meta_version=m.meta_version, priority=I32_MAX, epoch=agent.sealer.epoch)
            signature = agent.identity.sign(alive_signed_bytes(**fields))  # type: ignore[arg-type]
            greedy = g.Alive(**fields, signature=signature,  # type: ignore[arg-type]
                             certificate=setup.certificate)
            for addr in victims.values():
                agent.post(addr, (greedy,))
            await await_until("the greedy Alive refused", lambda: all(
                v >= 1 for v in delta(swarm.counted("priority_beyond_certificate"),
                                      before).values()))
            swarm.assert_unharmed(leader, made_up)
            costs.after("priority 2^31-1")

            # 2. the leader "left": unsigned, random bytes, signed with the rogue's key
            before = swarm.counted("unsigned_lefts")
            held = next(x for x in m.members() if x.node_id.hex() == leader)
            node = bytes.fromhex(leader)
            for step in range(6):
                incarnation = held.incarnation + 1 + step
                sig = (None, os.urandom(64), agent.identity.sign(
                    left_signed_bytes(node, incarnation)))[step % 3]
                for name, addr in victims.items():
                    if name != leader_name:
                        agent.post(addr, (g.Left(node, incarnation, sig),))
            await await_until("the forged Lefts refused", lambda: all(
                v >= 1 for n, v in delta(swarm.counted("unsigned_lefts"), before).items()
                if n != leader_name))
            swarm.assert_unharmed(leader, made_up)
            assert all(leader_name in present(d) for d in swarm.docs().values())
            costs.after("forged Lefts about the leader")

            # 3. 1,500 made-up self-signed members without certificates, in one sync
            ghosts = ghost_records(GHOSTS)
            made_up |= {r.name for r in ghosts}
            before = swarm.counted("uncertified")
            for addr in victims.values():
                reply = await agent.call(addr, g.SyncRecords(agent.node_id, tuple(ghosts)))
                assert isinstance(reply, g.SyncRecords)
            assert all(v >= GHOSTS for v in delta(swarm.counted("uncertified"),
                                                  before).values())
            swarm.assert_unharmed(leader, made_up)
            costs.after(f"{GHOSTS:,} made-up members in one SyncRecords")

            # 4. thousands of records with forged certificates and signatures
            flood = forged_records(FLOOD, certificate)
            made_up |= {r.name for r in flood}
            checks = ("bad_certificates", "signature_checks_refused")
            before_all = {c: swarm.counted(c) for c in checks}
            for addr in victims.values():
                for i in range(0, FLOOD, 1000):
                    reply = await agent.call(addr, g.SyncRecords(agent.node_id,
                                                                 tuple(flood[i:i + 1000])))
                    assert isinstance(reply, g.SyncRecords)
            grown = {c: delta(swarm.counted(c), before_all[c]) for c in checks}
            print("flood refusals", grown)
            for name in victims:
                assert grown["bad_certificates"][name] + grown[
                    "signature_checks_refused"][name] >= FLOOD, grown
                assert grown["bad_certificates"][name] <= 4 * 256, grown  # the message cap
            swarm.assert_unharmed(leader, made_up)
            costs.after(f"{FLOOD:,} records with forged certificates")
            print("what each attack cost the victims:", *costs.rows, sep="\n  ")
            # what `p2pswarm status --json` shows of it all, from an honest fellow that does
            # not lead (the Lefts about the leader went to the others only)
            witness = next(n for n in HONEST if n != leader_name)
            shown = await trio.to_thread.run_sync(lambda: cli(
                "status", "--home", str(swarm.homes[witness]), "--json"))
            assert shown.returncode == 0, shown.stderr
            doc = json.loads(shown.stdout)
            counted = doc["membership"]
            assert counted["uncertified"] >= GHOSTS and counted["unsigned_lefts"] >= 1
            assert counted["priority_beyond_certificate"] >= 1
            assert counted["bad_certificates"] + counted["signature_checks_refused"] >= FLOOD
            # no attack froze a victim's loop for a second (its whole cost is bounded by
            # the per-message and per-sender signature budgets)
            lags = {n: d["loop_lag"] for n, d in swarm.docs().items() if d is not None}
            print("victims' loop lag", lags)
            assert {n: lag["over_1_s"] for n, lag in lags.items()} == lag_before, lags

            # the leader is killed: a new honest leader within the deadline
            swarm.procs[leader_name].kill()
            swarm.procs.pop(leader_name).wait(10)
            rest = tuple(n for n in HONEST if n != leader_name)
            took_s = await await_until("a new honest leader", lambda: len(
                {leader_id(d) for d in swarm.docs(rest).values()}) == 1 and leader_id(
                status_of(swarm.homes[rest[0]])) not in (None, leader, agent.node_id.hex()),
                timeout_s=30)
            print(f"new leader after {took_s:.1f} s")
            for name, doc in swarm.docs(rest).items():
                assert doc is not None
                assert not {m["name"] for m in doc["members"]} & made_up, name
            nursery.cancel_scope.cancel()
