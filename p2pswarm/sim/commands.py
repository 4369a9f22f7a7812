"""`p2pswarm` commands as child processes, as a user types them, for the real-process
tests, the field scenarios and the security simulations: a command run to its end
(``cli``), a long-running one started (``start``, ``join``) and stopped as Ctrl-C stops it
(``stop``), the one line a refused one says (``refused_line``), what a running agent
answers (``status_of``, ``present``), and waiting for a condition with a deadline, polled,
never a fixed sleep (``poll``, ``took_s``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Union

from p2pswarm.control.client import request, stream
from p2pswarm.errors import ControlError, SwarmError

CLI: tuple[str, ...] = (sys.executable, "-m", "p2pswarm.cli")
POLL_S = 0.1  # between two looks at a condition: each look costs the agents a status
Sink = Union[int, IO[Any], None]  # where a child's output goes: PIPE, DEVNULL, a file


def hears_ctrl_c() -> None:
    """In a child about to start: Ctrl-C (SIGINT) as at a terminal. A shell starting a
    script in the background without job control (``script &``, ``nohup``) makes its
    children ignore SIGINT, and a fellow that ignores it would not leave when ``stop``
    asks it to (nor a command when a test presses Ctrl-C on it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(*args: str, timeout_s: float = 60.0, check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`p2pswarm ARGS` run to its end, its output captured as text, no terminal input."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL, check=check, env=env, cwd=cwd)


def start(*args: str, stdout: Sink = subprocess.PIPE, stderr: Sink = subprocess.PIPE,
          env: Mapping[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[str]:
    """`p2pswarm ARGS` started and left running; Ctrl-C (``stop``) reaches it."""
    return subprocess.Popen([*CLI, *args], stdout=stdout, stderr=stderr,
                            stdin=subprocess.DEVNULL, text=True, preexec_fn=hears_ctrl_c,
                            env=env, cwd=cwd)


def join(home: Path, *args: str, listen: str = "127.0.0.1:0",
         cards: tuple[str, ...] = ("--no-cpu",),
         output: Sink = subprocess.PIPE) -> subprocess.Popen[str]:
    """`p2pswarm join` from ``home`` with the local preset's timings and no HTTP API,
    offering ``cards`` (none by default); ``args`` are its seeds and other options.
    Read a PIPEd output only of a fellow that is to stop (``refused_line``): a long-lived
    one fills the pipe and blocks, so give it ``subprocess.DEVNULL``."""
    return start("join", "--home", str(home), "--preset", "local", *cards, "--http", "off",
                 "--listen", listen, *args, stdout=output, stderr=output)


def stop(*processes: subprocess.Popen[Any], timeout_s: float = 30.0,
         killing: Callable[[subprocess.Popen[Any]], None] | None = None) -> None:
    """Ctrl-C to each one still running, then wait for them all; one still running
    ``timeout_s`` later is killed (``killing`` hears of it first)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if killing is not None:
                killing(process)
            process.kill()
            process.wait(10)


def refused_line(process: subprocess.Popen[str], timeout_s: float = 90.0) -> str:
    """The one line a refused command says (``error: ...``), once it has exited: with
    code 1, that one error line and no traceback, or SwarmError showing what it said."""
    _, err = process.communicate(timeout=timeout_s)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    if process.returncode != 1 or len(errors) != 1 or "Traceback" in err:
        raise SwarmError(f"expected one error line and exit code 1, got "
                         f"{process.returncode}:\n{err[-2000:]}")
    return errors[0]


def status_of(home: Path) -> dict[str, Any] | None:
    """What the agent of ``home`` answers to `status`; None while it does not answer."""
    try:
        return request(home, {"op": "status"}, timeout_s=10)  # type: ignore[no-any-return]
    except SwarmError:
        return None


def present(doc: dict[str, Any] | None) -> set[str]:
    """The names a status shows alive or suspect (none for a fellow that did not answer)."""
    return set() if doc is None else {m["name"] for m in doc["members"]
                                      if m["state"] in ("alive", "suspect")}


def poll(what: str, ready: Callable[[], Any], timeout_s: float = 60.0, *,
         tolerate: tuple[type[BaseException], ...] = (), interval_s: float = POLL_S,
         watch: Callable[[], None] | None = None) -> Any:
    """``ready()``'s first true value within ``timeout_s``, or SwarmError naming
    ``what``; an exception in ``tolerate`` counts as not ready yet. Looked at every
    ``interval_s``, ``watch`` called between looks."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = ready()
        except tolerate:
            value = None
        if value:
            return value
        if watch is not None:
            watch()
        if time.monotonic() > deadline:
            raise SwarmError(f"gave up waiting for {what} after {timeout_s:g} s")
        time.sleep(interval_s)


def took_s(what: str, ready: Callable[[], Any], timeout_s: float = 60.0, *,
           tolerate: tuple[type[BaseException], ...] = ()) -> float:
    """The seconds until ``ready()`` held (``poll``)."""
    began = time.monotonic()
    poll(what, ready, timeout_s, tolerate=tolerate)
    return time.monotonic() - began


__all__ = ["CLI", "POLL_S", "Sink", "cli", "hears_ctrl_c", "join", "poll", "present",
           "refused_line", "start", "status_of", "stop", "took_s"]


def ask_first(homes: Iterable[Path], message: dict[str, Any], *, timeout_s: float = 10,
              streamed: bool = False) -> Any:
    """``message`` answered by the first fellow of ``homes`` that answers (``streamed``:
    an op that sends events before its answer, which are ignored); the last error when
    none does."""
    last: SwarmError = ControlError("no fellow is running")
    for home in homes:
        try:
            if streamed:
                return stream(home, message, lambda event: None, timeout_s=timeout_s)
            return request(home, message, timeout_s=timeout_s)
        except SwarmError as exc:
            last = exc
    raise last
