"""`join` under a handshake-slot flood, on real processes: a stranger keeps every
handshake slot of the seed taken from 64 source addresses 127.0.0.x (reconnecting as
soon as one is closed), and a new fellow still joins; a joiner refused by another
swarm's seed keeps the keyring it did not write."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pswarm.errors import SwarmError
from p2pswarm.home import Home
from p2pswarm.sim.commands import join, poll, status_of, stop
from p2pswarm.sim.field import free_port
from tests.test_join_token import OTHER_SECRET, SEED_SECRET, laptop_joins, wait_for_fellows

pytestmark = pytest.mark.slow  # real processes

SOURCES = 64


class SlotFlood:
    """Two connections from each of ``SOURCES`` addresses, never a hello; every one the
    seed closes is opened again at once, so the slots stay taken."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.reconnects = 0

    def __enter__(self) -> SlotFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _connect(self, source: str) -> socket.socket | None:
        sock = socket.socket()
        try:
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", self._port))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return sock

    def _run(self) -> None:
        held: dict[str, list[socket.socket]] = {f"127.0.0.{2 + i}": [] for i in range(SOURCES)}
        try:
            while not self._stop.is_set():
                for source, socks in held.items():
                    for sock in list(socks):
                        try:
                            if sock.recv(1) == b"":  # closed by the seed
                                raise ConnectionResetError
                        except BlockingIOError:
                            continue
                        except OSError:
                            pass
                        sock.close()
                        socks.remove(sock)
                        self.reconnects += 1
                    while len(socks) < 2:
                        sock = self._connect(source)
                        if sock is None:
                            break
                        socks.append(sock)
                self._stop.wait(0.02)
        finally:
            for socks in held.values():
                for sock in socks:
                    sock.close()


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """The seed both tests join (its home and port): the flood leaves nothing behind that
    the refused joiner meets, and the refused joiner changes nothing the flood counts."""
    root = tmp_path_factory.mktemp("flood")
    seed_home = root / "seed"
    Home(seed_home).join_swarm(SEED_SECRET)
    port = free_port()
    # its log to a file: a pipe nobody reads would fill over both tests and block it
    with open(root / "seed.log", "w") as log:
        process = join(seed_home, "--name", "seed", listen=f"127.0.0.1:{port}", output=log)
    try:
        wait_for_fellows(seed_home, process, 1)
        yield seed_home, port
    finally:
        stop(process)


def test_a_fellow_joins_while_a_stranger_holds_every_handshake_slot(
        seed: tuple[Path, int], tmp_path: Path) -> None:
    seed_home, port = seed
    home = tmp_path / "laptop"
    with SlotFlood(port) as flood:
        # the slots are full: the seed times the stranger out (the joiner goes on
        # after 30 s however many it timed out)
        with contextlib.suppress(SwarmError):
            poll("the seed timing the stranger out", lambda: flood.reconnects >= SOURCES,
                 30)
        laptop_joins(home, port)
        seen = status_of(seed_home)
        # the joiner's streams found the slots full and took the stranger's oldest
        assert seen is not None and seen["transport"]["handshakes_evicted"] >= 1
        assert seen["transport"]["streams_refused_busy"] == 0
    assert Home(home).has_swarm()


def test_a_joiner_refused_keeps_the_keyring_it_did_not_write(
        seed: tuple[Path, int], tmp_path: Path) -> None:
    _, port = seed
    home = tmp_path / "laptop"
    Home(home).join_swarm(OTHER_SECRET)  # an earlier run wrote it
    before = Home(home).keyring_path.read_bytes()
    wrong = join(home, f"127.0.0.1:{port}", "--name", "laptop", "--token",
                 OTHER_SECRET.token())  # the token the home already holds
    try:
        _, err = wrong.communicate(timeout=90)
    finally:
        stop(wrong)
    assert wrong.returncode == 1, err[-2000:]
    assert "the join token is not its swarm's" in err
    assert Home(home).keyring_path.read_bytes() == before  # kept, unchanged
