"""The stage orders of loads this fellow keeps, in memory and on its disk.

Theory of operation. A load's record lives on the leader, and its route and every
stage's order on the fellows it hands them (``StageStart`` to each stage's fellow,
``LoadKeep`` to a few keepers besides: ``keepers``). Memory alone forgets a load when
every fellow that knew it is gone or restarted at once: a one-stage load hosted by the
leader whose machine is killed, a swarm whose machines all reboot. So each fellow also
writes what it was handed to its state directory, one small file per load
(``HOME/loads/PLAN_ID.json``: the route and orders as the wire carried them, what the
load was asked as, and the term of the order), reads them back when it starts, and
gossips the plan ids it keeps without serving them (metadata ``kept_loads``). A leader
adopts such a load from them (``adoption``) and its heal re-places the stages no fellow
holds live.

A file is removed when the leader says to drop the load (``StageRelease``: an unload,
a stage moved away, a keeper no longer needed; ``LoadUnloaded``: a tombstone of that
bring-up, ``unload_memory``), never when the fellow itself stops.
Names and sizes are checked: a plan id becomes a file name only when it is a safe name,
at most ``MAX_KEPT`` loads are kept (a hostile leader cannot fill the disk), and a file
read back is bounded in bytes and decoded with the codec's strict checks; one that does
not pass is left out, removed, and counted.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.agent.serving.adoption import kept_orders
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.home import write_private
from p2pswarm.names import is_safe_name
from p2pswarm.wire import codec
from p2pswarm.wire.loads import RouteHop, StageAssignment, StageOrdersKept

log = logging.getLogger("p2pswarm.serving")

MAX_KEPT = 64  # loads one fellow keeps the orders of
MAX_FILE_BYTES = codec.DEFAULT_BYTES * 4 // 3 + 4096  # one order's bytes, in base64
_FORMAT = "p2pswarm-kept-load"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class KeptLoad:
    """The route and orders of one load as the last ``StageStart`` or ``LoadKeep`` this
    fellow obeyed handed them, and that order's term."""

    plan_id: str
    term: int
    route: tuple[RouteHop, ...]
    orders: tuple[StageAssignment, ...]
    asked: bytes = b""  # what the load was asked as, for a re-cut (b"": not known)

    def answer(self) -> StageOrdersKept:
        return StageOrdersKept(self.term, self.route, self.orders, self.asked)


class KeptLoads:
    """One fellow's kept loads; on disk under ``directory`` (None: in memory only)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.loads: dict[str, KeptLoad] = {}
        self.bad_files = 0  # left out when read back (damaged, too big, unfit)
        if directory is not None:
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("loads are kept in memory only (%s): %s", directory, exc)
                self.directory = None
                return
            self._read_back(directory)

    def plan_ids(self) -> list[str]:
        return sorted(self.loads)

    def get(self, plan_id: str) -> KeptLoad | None:
        return self.loads.get(plan_id)

    def keep(self, plan_id: str, term: int, route: tuple[RouteHop, ...],
             orders: tuple[StageAssignment, ...], asked: bytes = b"") -> bool:
        """Keep the (checked) route and orders of ``plan_id``; False when they are not
        kept: an older term than the kept one, or no room for another load."""
        before = self.loads.get(plan_id)
        if before is not None and before.term > term:
            return False
        if before is None and len(self.loads) >= MAX_KEPT:
            log.warning("kept the orders of %d loads already; not those of %s", MAX_KEPT,
                        plan_id)
            return False
        kept = KeptLoad(plan_id, term, route, orders, asked)
        self.loads[plan_id] = kept
        path = self._path(plan_id)
        if path is not None:
            try:
                data = codec.encode(kept.answer())
                write_private(path, {"format": _FORMAT, "version": _VERSION,
                                     "plan_id": plan_id, "term": term,
                                     "orders": base64.b64encode(data).decode("ascii")})
            except (SwarmError, OSError) as exc:
                log.warning("the orders of load %s are kept in memory only: %s", plan_id, exc)
        return True

    def forget(self, plan_id: str) -> bool:
        """Drop ``plan_id``'s orders, here and on disk; whether any were kept."""
        had = self.loads.pop(plan_id, None) is not None
        path = self._path(plan_id)
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)
        return had

    def _path(self, plan_id: str) -> Path | None:
        if self.directory is None or not is_safe_name(plan_id, 64):
            return None
        return self.directory / f"{plan_id}.json"

    def _read_back(self, directory: Path) -> None:
        try:
            paths = sorted(directory.glob("*.json"))
        except OSError as exc:
            log.warning("cannot read the kept loads in %s: %s", directory, exc)
            return
        for path in paths:
            plan_id = path.name[:-len(".json")]
            if len(self.loads) >= MAX_KEPT:
                log.warning("more than %d kept loads in %s: %s left out", MAX_KEPT,
                            directory, path.name)
                break
            try:
                self.loads[plan_id] = _read(path, plan_id)
            except (ConfigError, SwarmError, OSError, ValueError, TypeError) as exc:
                self.bad_files += 1
                log.warning("kept load %s left out and removed: %s", path, exc)
                try:
                    path.unlink()
                except OSError:
                    pass
        if self.loads:
            log.info("kept orders of %d loads read back from %s", len(self.loads), directory)


def _read(path: Path, plan_id: str) -> KeptLoad:
    """One kept load's file, checked: its name, size, format, and the orders as a leader
    would have to send them (``kept_orders``)."""
    if not is_safe_name(plan_id, 64):
        raise ConfigError("not a plan id")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ConfigError(f"larger than {MAX_FILE_BYTES} bytes")
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or document.get("format") != _FORMAT \
            or document.get("version") != _VERSION or document.get("plan_id") != plan_id:
        raise ConfigError(f"not a {_FORMAT} file of version {_VERSION} for {plan_id}")
    raw = document.get("orders")
    if not isinstance(raw, str):
        raise ConfigError("no orders")
    (kept,) = codec.decode(base64.b64decode(raw.encode("ascii"), validate=True))
    if not isinstance(kept, StageOrdersKept):
        raise ConfigError("not stage orders")
    kept_orders(plan_id, kept.route, kept.orders)
    return KeptLoad(plan_id, int(kept.started_term), kept.route, kept.orders, kept.asked)


__all__ = ["MAX_KEPT", "KeptLoad", "KeptLoads"]
