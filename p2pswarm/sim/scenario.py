"""Scenarios: what a simulation runs, read from a JSON (or TOML) file.

A scenario names the swarm (how many fellows, which radio profile each has, which
preset), how long it runs, what happens to it (scripted events at given times, and
events drawn at rates), what is measured along the way (plans for a fixed request,
samples of every fellow's view) and what the oracle insists on. Files live in
``p2pswarm/sim/scenarios/`` (shipped with the package; ``simulations/scenarios`` links
there); ``load_scenario`` takes a path or a bare name found there.

Example (JSON; the same keys work in TOML)::

    {
      "name": "w2-failover", "nodes": 20, "duration_s": 900, "preset": "wifi",
      "fellows": [{"profile": "wired", "count": 3, "leader_priority": 10},
                  {"profile": "W2"}],
      "events": [{"at_s": 120, "kind": "leader_kill", "restart_after_s": 60}],
      "rates": {"leader_kill_per_hour": 12, "leader_restart_after_s": [30, 90]}
    }

Event kinds: ``crash``, ``restart``, ``leave``, ``rejoin``, ``partition`` (``groups``:
lists of fellow indices, or ``split``: the fraction cut off), ``heal``, ``card_fill``
(``free_gb``), ``card_free``, ``leader_kill`` (optional ``restart_after_s``),
``join_burst`` (``count`` fellows not started yet), ``link_down`` / ``link_up`` (a
fellow's whole link, without stopping its process). ``fellow`` is an index or
``"random"`` (a running fellow, drawn from the run's seed). Rates are per hour of the
whole swarm (Poisson): ``crash``, ``leave``, ``card_change``, ``leader_kill``,
``partition``, with the time until the fellow comes back drawn from the ``*_after_s``
ranges (``null``: never).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.sim.profiles import PROFILES

# Shipped in the package (``pip install .`` carries them); simulations/scenarios links here.
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
EVENT_KINDS = ("crash", "restart", "leave", "rejoin", "partition", "heal", "card_fill",
               "card_free", "leader_kill", "join_burst", "link_down", "link_up")
RATE_KINDS = ("crash", "leave", "card_change", "leader_kill", "partition")
_TOP_KEYS = {"name", "description", "nodes", "start", "formed", "duration_s", "warmup_s",
             "stagger_s", "preset", "seed", "fellows", "events", "rates", "plan", "sample_every_s",
             "checks", "real", "training"}
DEFAULT_PLAN_REQUEST: dict[str, Any] = {"model": "llama-2-13b", "kind": "serve",
                                        "context": 4096}


@dataclass(frozen=True, slots=True)
class FellowGroup:
    profile: str
    count: int | None = None  # None: all fellows not counted by the other groups
    leader_priority: int = 0
    cpu_gb: float = 16.0


@dataclass(frozen=True, slots=True)
class ScriptedEvent:
    at_s: float
    kind: str
    fellow: int | str | None = None  # an index, "random", or None where not needed
    groups: tuple[tuple[int, ...], ...] = ()
    split: float | None = None
    free_gb: float | None = None
    count: int = 0
    restart_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Rates:
    crash_per_hour: float = 0.0
    crash_restart_after_s: tuple[float, float] | None = (30.0, 120.0)
    leave_per_hour: float = 0.0
    leave_rejoin_after_s: tuple[float, float] | None = (30.0, 120.0)
    card_change_per_hour: float = 0.0
    card_fill_free_gb: tuple[float, float] = (1.0, 8.0)
    leader_kill_per_hour: float = 0.0
    leader_restart_after_s: tuple[float, float] | None = (30.0, 90.0)
    partition_per_hour: float = 0.0
    partition_split: tuple[float, float] = (0.2, 0.45)
    partition_heal_after_s: tuple[float, float] = (10.0, 60.0)


@dataclass(frozen=True, slots=True)
class PlanProbe:
    every_s: float = 0.0  # 0: no plan probes
    request: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_PLAN_REQUEST))
    grace_s: float = 60.0  # a plan change this soon after a real change is explained by it


@dataclass(frozen=True, slots=True)
class TrainingSpec:
    """A training job the leader is given once the warm-up is over (``job``: a job.json;
    empty: none). Stage compute runs inline and each step takes ``step_s`` virtual
    seconds, so samples/s and loss under the scenario's faults come out exact."""
    job: dict[str, Any] = field(default_factory=dict)
    step_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Checks:
    detect_within_s: float = 60.0  # every observer must see a crash as dead within this
    max_suspect_s: float = 120.0  # no running, reachable fellow stays suspect longer
    # a running fellow must refute: none stays suspect or dead at a running fellow while
    # the two can reach each other for longer than this in all (however often cut apart
    # meanwhile), not counting the first refute_grace_s after each cut ends. Two rounds
    # of memberlist's 30 s push-pull: a fellow that lost the refutation's gossip to loss
    # learns it by anti-entropy (the baseline on W3 took 42 s so once)
    refute_within_s: float = 60.0
    refute_grace_s: float = 10.0
    converge_within_s: float = 120.0  # after the last fault, every view agrees again
    excuse_window_s: float = 30.0  # a verdict this soon after a cut is excused
    suspect_excuse_window_s: float = 5.0  # a suspicion this soon after a cut is excused
    blackout_min_s: float = 2.0  # a radio fade this long is a cut, like a roaming outage
    require_no_false_deaths: bool = False  # also fail on unexcused false deaths
    require_plan_stable: bool = True


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    nodes: int
    duration_s: float
    description: str = ""
    start: int | None = None  # fellows started at the beginning (None: all)
    formed: bool = False  # start them already knowing each other (no join phase)
    warmup_s: float = 60.0  # faults and measurements begin after this
    stagger_s: float = 0.05
    preset: str = "lan"
    seed: int = 1
    fellows: tuple[FellowGroup, ...] = (FellowGroup("wired"),)
    events: tuple[ScriptedEvent, ...] = ()
    rates: Rates = field(default_factory=Rates)
    plan: PlanProbe = field(default_factory=PlanProbe)
    sample_every_s: float = 10.0
    checks: Checks = field(default_factory=Checks)
    real: dict[str, Any] = field(default_factory=dict)
    training: TrainingSpec = field(default_factory=TrainingSpec)

    def profiles(self) -> list[tuple[str, int, float]]:
        """(profile, leader priority, CPU GB) for each fellow, in index order."""
        fixed = sum(g.count for g in self.fellows if g.count is not None)
        rest = [g for g in self.fellows if g.count is None]
        if fixed > self.nodes or (not rest and fixed != self.nodes):
            raise ConfigError(f"scenario {self.name}: the fellow groups count {fixed} "
                              f"fellows but nodes is {self.nodes}")
        out: list[tuple[str, int, float]] = []
        remaining = self.nodes - fixed
        for k, g in enumerate(self.fellows):
            if g.count is not None:
                n = g.count
            else:
                share = remaining // len(rest)
                n = share + (1 if rest.index(g) < remaining % len(rest) else 0)
            out += [(g.profile, g.leader_priority, g.cpu_gb)] * n
        return out

    def with_overrides(self, *, nodes: int | None = None, duration_s: float | None = None,
                       seed: int | None = None) -> Scenario:
        s = self
        if nodes is not None:
            if nodes < 2:
                raise ConfigError(f"--nodes must be at least 2, not {nodes}")
            s = replace(s, nodes=nodes, start=None if s.start is None
                        else min(s.start, nodes))
        if duration_s is not None:
            if not duration_s > 0:
                raise ConfigError(f"--duration must be > 0 seconds, not {duration_s}")
            s = replace(s, duration_s=float(duration_s),
                        warmup_s=min(s.warmup_s, float(duration_s) / 2))
        if seed is not None:
            s = replace(s, seed=seed)
        s.validate()
        return s

    def validate(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"scenario {self.name}: nodes must be at least 2")
        if not self.duration_s > 0:
            raise ConfigError(f"scenario {self.name}: duration_s must be > 0")
        self.profiles()
        for e in self.events:
            if isinstance(e.fellow, int) and not 0 <= e.fellow < self.nodes:
                raise ConfigError(f"scenario {self.name}: event {e.kind} at {e.at_s} s names "
                                  f"fellow {e.fellow}, but there are {self.nodes}")
            for g in e.groups:
                for i in g:
                    if not 0 <= i < self.nodes:
                        raise ConfigError(f"scenario {self.name}: partition at {e.at_s} s "
                                          f"names fellow {i}, but there are {self.nodes}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "nodes": self.nodes,
                "start": self.start, "duration_s": self.duration_s,
                "warmup_s": self.warmup_s, "preset": self.preset, "seed": self.seed,
                "fellows": [{"profile": g.profile, "count": g.count,
                             "leader_priority": g.leader_priority} for g in self.fellows],
                "events": len(self.events)}


# --- reading ---------------------------------------------------------------------------


def _pair(value: Any, what: str) -> tuple[float, float] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return (float(value), float(value))
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, (int, float)) for v in value) and value[0] <= value[1]):
        return (float(value[0]), float(value[1]))
    raise ConfigError(f"{what} must be a number or [low, high], not {value!r}")


def _number(d: dict[str, Any], key: str, default: float, what: str) -> float:
    value = d.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ConfigError(f"{what}.{key} must be a number, not {value!r}")
    return float(value)


def _event(d: Any, where: str) -> ScriptedEvent:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: an event is a table/object, not {d!r}")
    kind = d.get("kind")
    if kind not in EVENT_KINDS:
        raise ConfigError(f"{where}: unknown event kind {kind!r}: use one of "
                          f"{', '.join(EVENT_KINDS)}")
    at = _number(d, "at_s", -1, where)
    if at < 0:
        raise ConfigError(f"{where}: an event needs at_s >= 0")
    fellow = d.get("fellow")
    if fellow is not None and not (isinstance(fellow, int) or fellow == "random"):
        raise ConfigError(f"{where}: fellow must be an index or \"random\", not {fellow!r}")
    needs_fellow = kind in ("crash", "restart", "leave", "rejoin", "card_fill", "card_free",
                            "link_down", "link_up")
    if needs_fellow and fellow is None:
        raise ConfigError(f"{where}: a {kind} event needs a fellow")
    groups = tuple(tuple(int(i) for i in g) for g in d.get("groups", ()))
    split = d.get("split")
    if kind == "partition" and not groups and split is None:
        raise ConfigError(f"{where}: a partition needs groups or split")
    if split is not None and not (isinstance(split, (int, float)) and 0 < split < 1):
        raise ConfigError(f"{where}: split must be a fraction between 0 and 1")
    count = int(d.get("count", 0))
    if kind == "join_burst" and count < 1:
        raise ConfigError(f"{where}: a join_burst needs count >= 1")
    restart = d.get("restart_after_s")
    return ScriptedEvent(at, kind, fellow, groups, None if split is None else float(split),
                         d.get("free_gb"), count,
                         None if restart is None else float(restart))


def _training(d: Any, name: str) -> TrainingSpec:
    if not isinstance(d, dict) or set(d) - {"job", "step_s"}:
        raise ConfigError(f"scenario {name}: training takes job (a job.json table) and "
                          f"step_s, not {d!r}")
    job = d.get("job", {})
    if not isinstance(job, dict):
        raise ConfigError(f"scenario {name}: training.job must be a table/object")
    step_s = _number(d, "step_s", 1.0, "training")
    if not step_s > 0:
        raise ConfigError(f"scenario {name}: training.step_s must be > 0")
    return TrainingSpec(dict(job), step_s)


def scenario_from_dict(d: dict[str, Any], name: str = "scenario") -> Scenario:
    if not isinstance(d, dict):
        raise ConfigError(f"scenario {name}: the file must hold one table/object")
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"scenario {name}: unknown keys {', '.join(sorted(unknown))}")
    name = str(d.get("name", name))
    groups = []
    for g in d.get("fellows", [{"profile": "wired"}]):
        if not isinstance(g, dict) or g.get("profile") not in PROFILES:
            raise ConfigError(f"scenario {name}: each fellows entry needs a profile, one of "
                              f"{', '.join(PROFILES)}; got {g!r}")
        count = g.get("count")
        if count is not None and (not isinstance(count, int) or count < 0):
            raise ConfigError(f"scenario {name}: fellows count must be an integer >= 0")
        groups.append(FellowGroup(g["profile"], count, int(g.get("leader_priority", 0)),
                                  float(g.get("cpu_gb", 16.0))))
    rates_d = d.get("rates", {})
    rate_kw: dict[str, Any] = {}
    for key, value in rates_d.items():
        if key.endswith("_per_hour") and key[:-9] in RATE_KINDS:
            rate_kw[key] = _number(rates_d, key, 0.0, "rates")
        elif key in ("crash_restart_after_s", "leave_rejoin_after_s",
                     "leader_restart_after_s"):
            rate_kw[key] = _pair(value, f"rates.{key}")
        elif key in ("card_fill_free_gb", "partition_split", "partition_heal_after_s"):
            pair = _pair(value, f"rates.{key}")
            assert pair is not None
            rate_kw[key] = pair
        else:
            raise ConfigError(f"scenario {name}: unknown rate {key!r}")
    plan_d = d.get("plan", {})
    plan = PlanProbe(every_s=_number(plan_d, "every_s", 0.0, "plan"),
                     request=dict(plan_d.get("request", DEFAULT_PLAN_REQUEST)),
                     grace_s=_number(plan_d, "grace_s", 60.0, "plan"))
    checks_d = d.get("checks", {})
    checks = Checks(**{k: (bool(v) if k.startswith("require") else float(v))  # type: ignore[arg-type]
                       for k, v in checks_d.items() if k in Checks.__dataclass_fields__})
    if set(checks_d) - set(Checks.__dataclass_fields__):
        raise ConfigError(f"scenario {name}: unknown checks "
                          f"{', '.join(sorted(set(checks_d) - set(Checks.__dataclass_fields__)))}")
    nodes = d.get("nodes")
    if not isinstance(nodes, int) or nodes < 2:
        raise ConfigError(f"scenario {name}: nodes must be an integer >= 2")
    scenario = Scenario(
        name=name, description=str(d.get("description", "")), nodes=nodes,
        start=d.get("start"), formed=bool(d.get("formed", False)),
        duration_s=_number(d, "duration_s", 600.0, name),
        warmup_s=_number(d, "warmup_s", 60.0, name),
        stagger_s=_number(d, "stagger_s", 0.05, name), preset=str(d.get("preset", "lan")),
        seed=int(d.get("seed", 1)), fellows=tuple(groups),
        events=tuple(sorted((_event(e, f"scenario {name} event {k}")
                             for k, e in enumerate(d.get("events", []))),
                            key=lambda e: e.at_s)),
        rates=Rates(**rate_kw), plan=plan,
        sample_every_s=_number(d, "sample_every_s", 10.0, name), checks=checks,
        real=dict(d.get("real", {})), training=_training(d.get("training", {}), name))
    if scenario.preset not in ("lan", "wifi", "local"):
        raise ConfigError(f"scenario {name}: preset must be lan, wifi or local")
    scenario.validate()
    return scenario


def find_scenario(spec: str) -> Path:
    """A scenario file from a path, or a bare name in the scenario folder."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    for suffix in (".json", ".toml"):
        candidate = SCENARIO_DIR / f"{spec}{suffix}"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in SCENARIO_DIR.glob("*.json")) + \
        sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    raise ConfigError(f"no scenario {spec!r}: give a file path or one of "
                      f"{', '.join(known) or '(none found)'}")


def _toml_module() -> Any:
    try:
        import tomllib
        return tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli
            return tomli
        except ModuleNotFoundError:
            raise ConfigError("TOML scenarios need Python 3.11 or the tomli package "
                              "(pip install tomli); JSON scenarios need nothing") from None


def load_scenario(spec: str) -> Scenario:
    path = find_scenario(spec)
    try:
        if path.suffix == ".toml":
            data = _toml_module().loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from None
    return scenario_from_dict(data, path.stem)


def available_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json")) + \
        sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


__all__ = [
    "EVENT_KINDS",
    "SCENARIO_DIR",
    "Checks",
    "FellowGroup",
    "PlanProbe",
    "Rates",
    "Scenario",
    "ScriptedEvent",
    "TrainingSpec",
    "available_scenarios",
    "find_scenario",
    "load_scenario",
    "scenario_from_dict",
]
