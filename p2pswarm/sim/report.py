"""Reports of simulation runs: a JSON result, a markdown table, PNG plots.

``results`` is a list of run results (``run_scenario``'s dicts), one per variant
(ours, then the baseline when asked) of the same scenario and seed. The table puts the
variants side by side; the plots overlay them. Plots need matplotlib; without it the
other files are still written and ``write_reports`` says which plots were skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from p2pswarm.sim.conclusions import GLOSSARY, conclusions
from p2pswarm.sim.metrics import ecdf


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "never"
        if math.isnan(value):
            return "-"
        text = f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"
    else:
        text = f"{value:,}" if isinstance(value, int) else str(value)
    return f"{text}{unit}"


ROWS: list[tuple[str, Any]] = [
    ("verdict", lambda r: "ok" if r["ok"] else f"FAIL ({len(r['failures'])})"),
    ("fellows / virtual time", lambda r: f"{r['nodes']} / {_fmt(r['duration_s'], ' s')}"),
    ("crash to dead p50", lambda r: _fmt(r["crash_to_dead_s"]["p50"], " s")),
    ("crash to dead p99", lambda r: _fmt(r["crash_to_dead_s"]["p99"], " s")),
    ("detections (crash x observer)", lambda r: _fmt(r["crash_to_dead_s"]["count"])),
    ("false suspicions (episodes)", lambda r: _fmt(r["false_suspicions"])),
    ("false suspicions per node-hour", lambda r: _fmt(r["false_suspicions_per_node_hour"])),
    ("... of reachable fellows", lambda r: _fmt(r["false_suspicions_unexcused"])),
    ("false deaths (episodes)", lambda r: _fmt(r["false_deaths"])),
    ("... of reachable fellows", lambda r: _fmt(r["false_deaths_unexcused"])),
    ("false deaths per node-hour", lambda r: _fmt(r["false_deaths_per_node_hour"])),
    ("flaps", lambda r: _fmt(r["flaps"])),
    ("suspicions over the limit", lambda r: _fmt(r["long_suspicions"])),
    ("suspect or dead while reachable, unrefuted", lambda r: _fmt(r["unrefuted_beliefs"])),
    ("leader changes", lambda r: _fmt(r["leader_changes"])),
    ("two leaders in one term", lambda r: _fmt(r["terms_with_two_leaders"])),
    ("leader failover p50", lambda r: _fmt(r["leader_failover_s"]["p50"], " s")),
    ("leader failover p99", lambda r: _fmt(r["leader_failover_s"]["p99"], " s")),
    ("update to all, rounds p99", lambda r: _fmt(r["update_rounds"]["p99"])),
    ("update to all, rounds p99.99", lambda r: _fmt(r["update_rounds_p9999"])),
    ("plan changes / unexplained", lambda r: f"{r['plan']['changes']} / "
                                             f"{r['plan']['changes_unexplained']}"),
    ("pinned loads refused", lambda r: _fmt(r["plan"]["pinned_refused_fraction"])),
    ("datagrams out per fellow-s", lambda r: _fmt(r["traffic"]["datagrams_out_per_fellow_s"]
                                                  ["mean"])),
    ("bytes out per fellow-s", lambda r: _fmt(r["traffic"]["bytes_out_per_fellow_s"]["mean"])),
    ("training: samples/s", lambda r: _fmt(r["training"]["samples_per_s"])),
    ("training: loss first -> last 5", lambda r: f"{_fmt(r['training']['loss_first'])} -> "
                                                 f"{_fmt(r['training']['loss_end'])}"),
    ("wall / CPU seconds", lambda r: f"{_fmt(r.get('wall_s'))} / {_fmt(r.get('cpu_s'))}"),
    ("trace hash", lambda r: r["trace_hash"][:16]),
]


def markdown(results: list[dict[str, Any]]) -> str:
    first = results[0]
    head = (f"### {first['scenario']['name']} (seed {first['seed']}, {first['nodes']} fellows, "
            f"{_fmt(first['duration_s'])} virtual s)\n\n")
    names = [f"{r['variant']} ({r['preset']})" for r in results]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(results)]
    for label, get in ROWS:
        cells = []
        for r in results:
            try:
                cells.append(str(get(r)))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    out = head + "\n".join(lines) + "\n"
    for r in results:
        for failure in r["failures"]:
            out += f"\n- {r['variant']}: {failure}"
        for note in r.get("notes", [])[:5]:
            out += f"\n- {r['variant']} note: {note}"
    out += "\n\n#### What to conclude\n\n" + "".join(f"- {c}\n" for c in conclusions(results))
    out += "\n#### What the numbers count\n\n" + "".join(f"- {g}\n" for g in GLOSSARY)
    return out


def public(result: dict[str, Any]) -> dict[str, Any]:
    """The result without the long series (for --json on a terminal)."""
    out = {k: v for k, v in result.items() if not k.startswith("_") and k != "views"}
    out["traffic"] = {k: v for k, v in result["traffic"].items() if not k.startswith("_")}
    return out


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    return json.dumps(_json_safe(obj), indent=2)


def write_reports(results: list[dict[str, Any]], out_dir: Path) -> list[str]:
    """Write result.json, report.md and the plots into ``out_dir``; return notes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(to_json(results if len(results) > 1 else results[0]))
    (out_dir / "report.md").write_text(markdown(results))
    return plot(results, out_dir)


def plot(results: list[dict[str, Any]], out_dir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install matplotlib)"]
    name = results[0]["scenario"]["name"]
    styles = ["-", "--", ":", "-."]

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, r in enumerate(results):
        xs, ys = ecdf(r["_detect"])
        if xs:
            ax.step(xs, ys, where="post", linestyle=styles[k % 4], label=r["variant"])
    ax.set_xlabel("crash to dead at an observer (s)")
    ax.set_ylabel("fraction of (crash, observer)")
    ax.set_title(f"{name}: detection time CDF")
    if any(r["_detect"] for r in results):
        ax.legend()
    _save(fig, ax, out_dir / "detection_cdf.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, r in enumerate(results):
        times = sorted(r["_false_suspicion_times"])
        ax.step([r["warmup_s"], *times, r["duration_s"]],
                [0, *range(1, len(times) + 1), len(times)], where="post",
                linestyle=styles[k % 4], label=r["variant"])
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("false suspicions so far (episodes)")
    ax.set_title(f"{name}: false suspicions over time")
    ax.legend()
    _save(fig, ax, out_dir / "false_suspicions.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, r in enumerate(results):
        values = sorted(r["traffic"]["_bytes_out_per_fellow_s"])
        ax.plot(range(len(values)), values, linestyle=styles[k % 4], marker=".",
                label=r["variant"])
    ax.set_xlabel("fellows, sorted")
    ax.set_ylabel("datagram bytes sent per second")
    ax.set_title(f"{name}: bytes per fellow")
    ax.legend()
    _save(fig, ax, out_dir / "bytes_per_fellow.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    colors = {"alive": "tab:green", "suspect": "tab:orange", "dead": "tab:red",
              "missing": "tab:gray"}
    for k, r in enumerate(results):
        views = r["views"]
        if not views:
            continue
        ts = [v["t"] for v in views]
        for state, color in colors.items():
            ax.plot(ts, [v[state] for v in views], color=color, linestyle=styles[k % 4],
                    label=f"{r['variant']}: {state}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("fraction of beliefs about running fellows")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title(f"{name}: membership view over time")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, ax, out_dir / "membership_view.png")
    return []


def _save(fig: Any, ax: Any, path: Path) -> None:
    """Every plot's finish: a light grid, a tight layout, a PNG, the figure closed."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["GLOSSARY", "conclusions", "markdown", "plot", "public", "to_json",
           "write_reports"]
