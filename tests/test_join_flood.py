"""`join` under a handshake-slot flood, on real processes: a stranger keeps every
handshake slot of the seed taken from 64 source addresses 127.0.0.x (reconnecting as
soon as one is closed), and a new fellow still joins; a joiner refused by another
swarm's seed keeps the keyring it did not write."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from p2pswarm.home import Home
from p2pswarm.sim.field import free_port
from tests.test_join_token import OTHER_SECRET, SEED_SECRET, join, status, stop, wait_for_fellows

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


def test_a_fellow_joins_while_a_stranger_holds_every_handshake_slot(tmp_path: Path) -> None:
    seed_home, home = tmp_path / "seed", tmp_path / "laptop"
    Home(seed_home).join_swarm(SEED_SECRET)
    port = free_port()
    seed = join(seed_home, "--listen", f"127.0.0.1:{port}", "--name", "seed")
    try:
        wait_for_fellows(seed_home, seed, 1)
        with SlotFlood(port) as flood:
            deadline = time.monotonic() + 30
            while flood.reconnects < SOURCES and time.monotonic() < deadline:
                time.sleep(0.1)  # the slots are full: the seed times the stranger out
            joiner = join(home, f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--name",
                          "laptop", "--token", SEED_SECRET.token())
            try:
                data = wait_for_fellows(home, joiner, 2)
                assert {m["name"] for m in data["members"]} == {"seed", "laptop"}
            finally:
                stop(joiner)
            seen = status(seed_home)
            # the joiner's streams found the slots full and took the stranger's oldest
            assert seen is not None and seen["transport"]["handshakes_evicted"] >= 1
            assert seen["transport"]["streams_refused_busy"] == 0
        assert Home(home).has_swarm()
    finally:
        stop(seed)


def test_a_joiner_refused_keeps_the_keyring_it_did_not_write(tmp_path: Path) -> None:
    seed_home, home = tmp_path / "seed", tmp_path / "laptop"
    Home(seed_home).join_swarm(SEED_SECRET)
    Home(home).join_swarm(OTHER_SECRET)  # an earlier run wrote it
    before = Home(home).keyring_path.read_bytes()
    port = free_port()
    seed = join(seed_home, "--listen", f"127.0.0.1:{port}", "--name", "seed")
    try:
        wait_for_fellows(seed_home, seed, 1)
        wrong = join(home, f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--name", "laptop",
                     "--token", OTHER_SECRET.token())  # the token the home already holds
        try:
            _, err = wrong.communicate(timeout=90)
        finally:
            stop(wrong)
        assert wrong.returncode == 1, err[-2000:]
        assert "the join token is not its swarm's" in err
        assert Home(home).keyring_path.read_bytes() == before  # kept, unchanged
    finally:
        stop(seed)
