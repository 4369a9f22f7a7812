"""Tombstones: an unload remembered by the fellows, so that no later leader brings it back.

Theory of operation. A load's orders are kept on the disks of its stage fellows, its
keepers and its leader (``kept_loads``), and a leader adopts a load it finds kept
(``adoption``). An unload removes them from every fellow it reaches; a fellow that was
away (down, cut off) keeps them, and comes back gossiping them. The leader that unloaded
remembers the unload, but after a change of leader only the fellows can. So the leader
writes a tombstone, ``(plan_id, generation, term)``, and hands it (``LoadUnloaded``) to
every connected fellow; each keeps it on its disk for ``KEEP_S`` (``MAX_KEPT`` at most,
the oldest go first). Before a leader adopts a load it asks its fellows which unloads of
that plan they remember (``UnloadsAsk``), and adopts no bring-up a tombstone covers; the
fellows that keep a covered bring-up are handed the tombstone, and drop it.

A tombstone covers one bring-up, not the plan id: every load draws a random
``generation`` that its stage orders carry (kept across moves and adoptions), so a later
``load`` of the same plan is a new generation the tombstone does not cover. Orders kept
from before generations existed (``""``) are never covered.

Every record from the network is checked: the plan id a safe name, the generation
lowercase hex, the unload's term no later than the current one; an answer names at most
``MAX_TOMBSTONES_SHOWN``. Only the elected leader's orders are obeyed (``Leadership``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.errors import ConfigError
from p2pswarm.home import write_private
from p2pswarm.names import is_safe_name
from p2pswarm.wire.loads import MAX_TOMBSTONES_SHOWN, UnloadRecord

log = logging.getLogger("p2pswarm.serving")

KEEP_S = 7 * 24 * 3600.0  # a fellow away longer than this may bring an unloaded load back
MAX_KEPT = 256  # tombstones one fellow keeps (a hostile leader cannot fill its disk)
FILE_NAME = "unloaded"  # in the kept loads' directory; not a PLAN_ID.json
MAX_FILE_BYTES = 128 * 1024
_FORMAT = "p2pswarm-unloads"
_VERSION = 1
_GENERATION = re.compile(r"[0-9a-f]{1,16}")


def is_generation(value: object) -> bool:
    return isinstance(value, str) and _GENERATION.fullmatch(value) is not None


def unfit(record: UnloadRecord, term_now: int) -> str | None:
    """Why ``record`` (from the network) is not to be kept; None when it fits."""
    if not is_safe_name(record.plan_id, 64):
        return "its plan id is not a safe name"
    if not is_generation(record.generation):
        return "its generation is not hex"
    if record.unloaded_term > term_now:
        return f"its term {record.unloaded_term} is later than the current {term_now}"
    return None


@dataclass(frozen=True, slots=True)
class Tombstone:
    """Load ``plan_id`` brought up as ``generation`` was unloaded in ``unloaded_term``;
    ``learned_at`` is this fellow's wall clock when it learned it (never the network's)."""

    plan_id: str
    generation: str
    unloaded_term: int
    learned_at: float

    def to_wire(self) -> UnloadRecord:
        return UnloadRecord(self.plan_id, self.generation, self.unloaded_term)


class Tombstones:
    """One fellow's tombstones, in memory and in ``path`` (None: in memory only)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.kept: dict[tuple[str, str], Tombstone] = {}  # oldest learned first
        self.bad_file = False
        if path is not None:
            self._read_back(path)

    def remember(self, record: UnloadRecord) -> bool:
        """Keep ``record`` (checked by the caller); whether it was new here."""
        key = (record.plan_id, record.generation)
        if key in self.kept:
            return False
        self.kept[key] = Tombstone(record.plan_id, record.generation, record.unloaded_term,
                                   self.clock())
        self._bound()
        self._save()
        return True

    def covers(self, plan_id: str, generation: str) -> Tombstone | None:
        """The tombstone of that bring-up of ``plan_id``, if this fellow knows one."""
        self._bound()
        return self.kept.get((plan_id, generation)) if generation else None

    def of_plan(self, plan_id: str) -> list[Tombstone]:
        """The unloads of ``plan_id`` known here, the latest learned first (bounded)."""
        self._bound()
        mine = [t for t in self.kept.values() if t.plan_id == plan_id]
        return mine[::-1][:MAX_TOMBSTONES_SHOWN]

    def _bound(self) -> None:
        """Forget tombstones older than ``KEEP_S``, and the oldest beyond ``MAX_KEPT``."""
        now = self.clock()
        stale = [k for k, t in self.kept.items() if not 0 <= now - t.learned_at < KEEP_S]
        for key in stale:
            del self.kept[key]
        while len(self.kept) > MAX_KEPT:
            del self.kept[next(iter(self.kept))]
        if stale:
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        rows = [[t.plan_id, t.generation, t.unloaded_term, t.learned_at]
                for t in self.kept.values()]
        try:
            write_private(self.path, {"format": _FORMAT, "version": _VERSION,
                                      "unloads": rows})
        except (ConfigError, OSError) as exc:
            log.warning("unloads are remembered in memory only: %s", exc)

    def _read_back(self, path: Path) -> None:
        try:
            if not path.exists():
                return
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ConfigError(f"larger than {MAX_FILE_BYTES} bytes")
            document = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(document, dict) or document.get("format") != _FORMAT \
                    or document.get("version") != _VERSION \
                    or not isinstance(document.get("unloads"), list):
                raise ConfigError(f"not a {_FORMAT} file of version {_VERSION}")
            for row in document["unloads"][-MAX_KEPT:]:
                plan_id, generation, term, at = row
                if not is_safe_name(plan_id, 64) or not is_generation(generation) \
                        or type(term) is not int or term < 0 \
                        or type(at) not in (int, float):
                    raise ConfigError(f"an unfit row {row!r:.80}")
                self.kept[(plan_id, generation)] = Tombstone(plan_id, generation, term,
                                                             float(at))
        except (ConfigError, OSError, ValueError, TypeError) as exc:
            self.bad_file = True
            self.kept.clear()
            log.warning("remembered unloads %s left out and removed: %s", path, exc)
            try:
                path.unlink()
            except OSError:
                pass
            return
        self._bound()


__all__ = ["KEEP_S", "MAX_KEPT", "Tombstone", "Tombstones", "is_generation", "unfit"]
