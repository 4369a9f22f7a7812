"""A job's state as a document: what the leader copies to fellows, what a new leader reads.

``snapshot(job, driver)`` is the job's record (config, placement, progress, checkpoint)
and, while a driver runs it, where its rounds stand: the keepers' global version and
each replica's data position, optimizer steps (its place in the learning-rate schedule),
rounds done, placement generation and whether it was paused. ``restore(doc)`` reads such
a document back into a ``Job`` and a ``RoundsState``, checking every field's type and
bound first: the document came over the network, and a bad one is refused with one line
(``RemoteProtocolError``), never half applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.agent.training.job_paths import JOB_ID
from p2pswarm.agent.training.job_record import (
    LOSSES_KEPT,
    ROUNDS_KEPT,
    STATES,
    Job,
    Running,
    job_config,
)
from p2pswarm.agent.training.placed import (
    MAX_INT,
    MAX_REPLICAS,
    MAX_STAGES,
    placement_from_doc,
    placement_to_doc,
)
from p2pswarm.agent.training.round_entry import RoundEntry
from p2pswarm.errors import ConfigError, RemoteProtocolError

MOVES_KEPT = 20  # "moved" lines a job record carries
TEXT = 4096  # the longest free text (a reason, a moved line) a copy may carry


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """Where one replica stood when the copy was made."""

    index: int
    paused: bool
    generation: int
    steps: int  # optimizer steps taken: its place in the learning-rate schedule
    position: int  # its data stream's position
    rounds_done: int


@dataclass(frozen=True, slots=True)
class RoundsState:
    """Where a job's rounds stood: the keepers' version and every replica's place."""

    version: int
    replicas: tuple[ReplicaState, ...]


def snapshot(job: Job, driver: Running | None, leader: str) -> dict[str, Any]:
    """The job's record and, while ``driver`` runs it, where its rounds stand; ``leader``
    names the leader that made it."""
    doc: dict[str, Any] = {
        "leader": leader, "job_id": job.job_id, "config": job.config.to_dict(),
        "plan_id": job.plan_id,
        "pinned": job.pinned, "stages": job.stages, "resume": job.resume,
        "state": job.state, "reason": job.reason[:TEXT], "step": job.step,
        "loss": job.loss, "losses": job.losses[-LOSSES_KEPT:],
        "tokens_per_s": job.tokens_per_s, "replicas": job.replicas,
        "bytes_sent": job.bytes_sent, "samples": job.samples,
        "checkpoint": job.checkpoint[:TEXT], "checkpoint_step": job.checkpoint_step,
        "copies": job.copies, "placement": placement_to_doc(job.placement, job.config),
        "rejoins": job.rejoins, "paused_times": job.paused_times,
        "generation": job.generation, "rounds": [r.to_doc() for r in job.rounds[-ROUNDS_KEPT:]],
        "replica_steps": job.replica_steps, "maximize": job.maximize,
        "exclude_cards": job.exclude_cards, "moves": job.moves[-MOVES_KEPT:],
        "rounds_state": None}
    if driver is not None and driver.replicas and all(r.data is not None
                                                      for r in driver.replicas):
        doc["rounds_state"] = {
            "version": driver.keepers[0].version if driver.keepers else 0,
            "replicas": [{"index": r.index, "paused": bool(r.paused),
                          "generation": r.generation, "steps": r.steps,
                          # a new leader puts every replica on the global state:
                          # its data goes on from where its last delta left
                          "position": r.kept_position, "rounds_done": r.rounds_done}
                         for r in driver.replicas]}
    return doc


# --- reading a copy back ----------------------------------------------------------------------


@dataclass
class Handed:
    """A job taken over: where its rounds stood, the keepers' outer state, and what the
    driver is to do with them."""

    rounds: RoundsState | None
    outer: tuple[bytes, ...]
    from_leader: str
    lost: dict[int, str] = field(default_factory=dict)  # replica -> why it is not placed
    generation: int = 0  # the placement generation the replicas were ordered back with
    restore_rounds: bool = False


def _bad(what: str) -> RemoteProtocolError:
    return RemoteProtocolError("bad-job-copy", f"a job copy's {what} is malformed")


def _int(doc: Mapping[str, Any], key: str, high: int = MAX_INT) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise _bad(key)
    return value


def _text(doc: Mapping[str, Any], key: str, high: int = TEXT) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > high:
        raise _bad(key)
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise _bad(key)
    return float(value)


def _list(doc: Mapping[str, Any], key: str, high: int) -> list[Any]:
    value = doc.get(key)
    if not isinstance(value, list) or len(value) > high:
        raise _bad(key)
    return value


def _copies(value: Any) -> dict[str, list[str]]:
    if not isinstance(value, dict) or len(value) > MAX_REPLICAS * MAX_STAGES + MAX_STAGES:
        raise _bad("copies")
    for name, holders in value.items():
        if not isinstance(name, str) or not isinstance(holders, list) or not all(
                isinstance(h, str) for h in holders):
            raise _bad("copies")
    return {str(k): list(v) for k, v in value.items()}


def _rounds_state(value: Any) -> RoundsState | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("rounds_state")
    replicas = []
    for r in _list(value, "replicas", MAX_REPLICAS):
        if not isinstance(r, dict) or not isinstance(r.get("paused"), bool):
            raise _bad("rounds_state")
        replicas.append(ReplicaState(
            _int(r, "index", MAX_REPLICAS - 1), r["paused"], _int(r, "generation", 2**32 - 1),
            _int(r, "steps"), _int(r, "position"), _int(r, "rounds_done")))
    if [r.index for r in replicas] != list(range(len(replicas))):
        raise _bad("rounds_state")
    return RoundsState(_int(value, "version"), tuple(replicas))


def restore(doc: dict[str, Any]) -> tuple[Job, RoundsState | None]:
    """A copy's job (its record, ready to be driven again) and where its rounds stood."""
    job_id = _text(doc, "job_id", 64)
    if not JOB_ID.fullmatch(job_id):
        raise _bad("job_id")
    config = doc.get("config")
    if not isinstance(config, dict):
        raise _bad("config")
    state = _text(doc, "state", 16)
    if state not in STATES:
        raise _bad("state")
    stages = doc.get("stages")
    if stages is not None:
        stages = _int(doc, "stages", 65535)
    maximize = doc.get("maximize")
    if maximize not in (None, "seq_len"):
        raise _bad("maximize")
    loss = doc.get("loss")
    exclude = _list(doc, "exclude_cards", 1024)
    if not all(isinstance(e, str) and len(e) <= 96 for e in exclude):
        raise _bad("exclude_cards")
    moves = _list(doc, "moves", MOVES_KEPT)
    if not all(isinstance(m, str) and len(m) <= TEXT for m in moves):
        raise _bad("moves")
    replica_steps = doc.get("replica_steps")
    if not isinstance(replica_steps, dict) or len(replica_steps) > MAX_REPLICAS or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in replica_steps.items()):
        raise _bad("replica_steps")
    rounds = [RoundEntry.from_doc(r) for r in _list(doc, "rounds", ROUNDS_KEPT)]
    for key in ("pinned", "resume"):
        if not isinstance(doc.get(key), bool):
            raise _bad(key)
    try:
        cfg = job_config(config)
    except ConfigError as exc:
        raise RemoteProtocolError("bad-job-copy", f"a job copy's config: {exc}") from None
    job = Job(job_id, cfg, _text(doc, "plan_id", 64), pinned=doc["pinned"],
              stages=stages, resume=doc["resume"], state=state, reason=_text(doc, "reason"),
              step=_int(doc, "step"),
              loss=None if loss is None else _float(loss, "loss"),
              losses=[_float(x, "losses") for x in _list(doc, "losses", LOSSES_KEPT)],
              tokens_per_s=_float(doc.get("tokens_per_s"), "tokens_per_s"),
              replicas=_int(doc, "replicas", MAX_REPLICAS), bytes_sent=_int(doc, "bytes_sent"),
              samples=_int(doc, "samples"), checkpoint=_text(doc, "checkpoint"),
              checkpoint_step=_int(doc, "checkpoint_step"), copies=_copies(doc.get("copies")),
              placement=placement_from_doc(doc.get("placement"), cfg), rejoins=_int(doc, "rejoins"),
              paused_times=_int(doc, "paused_times", 2**32 - 1), rounds=rounds,
              generation=_int(doc, "generation", 2**32 - 1) if "generation" in doc else 0,
              replica_steps=dict(replica_steps), maximize=maximize, exclude_cards=exclude,
              moves=list(moves))
    rounds_state = _rounds_state(doc.get("rounds_state"))
    if rounds_state is not None and len(rounds_state.replicas) != len(job.placement):
        raise _bad("rounds_state")
    return job, rounds_state


__all__ = ["MOVES_KEPT", "Handed", "ReplicaState", "RoundsState", "restore", "snapshot"]
