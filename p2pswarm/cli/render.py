"""Human output of a plan: the limit sentence, the layer strip, each stage with its weights
dtype and why, one bar per card grouped by fellow (segments in colour, does-not-fit in
red past the bar's end, the stage's dtype), a table of cards, the summary. Works on the
plan's dict, so a plan that came back from the agent renders exactly like one made here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from p2pswarm.planner import wording

BAR_WIDTH = 48
SEGMENT_STYLES = (
    ("other_programs", "grey42", "other programs"),
    ("weights", "blue", "weights"),
    ("embeddings_head_buffers", "cyan", "embeddings/head/buffers"),
    ("kv_cache", "magenta", "KV cache"),
    ("activations", "yellow", "activations"),
    ("optimizer", "dark_orange", "optimizer"),
    ("lora", "green", "LoRA"),
    ("workspace", "white", "workspace"),
    ("free", "grey23", "free"),
)
STAGE_STYLES = ("blue", "green", "magenta", "cyan", "yellow", "dark_orange", "purple", "red3")


def _cells(amounts: Sequence[int], width: int) -> list[int]:
    """Character cells per amount, adding up to ``width`` (largest remainder), and at
    least one cell for any non-zero amount that has room."""
    total = sum(amounts)
    if total <= 0:
        return [0] * len(amounts)
    exact = [a * width / total for a in amounts]
    cells = [int(e) for e in exact]
    order = sorted(range(len(amounts)), key=lambda i: (-(exact[i] - cells[i]), i))
    for i in order[:width - sum(cells)]:
        cells[i] += 1
    for i, a in enumerate(amounts):  # a thin segment still shows
        if a > 0 and cells[i] == 0:
            donor = max(range(len(cells)), key=lambda j: (cells[j], -j))
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def card_bar(card: Mapping[str, Any], width: int = BAR_WIDTH, overflow: int = 12) -> Text:
    """The card's segments across ``width`` cells, then up to ``overflow`` red cells for
    what runs past its end (padded, so the columns after the bar line up)."""
    seg = card["segments"]
    amounts = [seg[name] for name, _, _ in SEGMENT_STYLES]
    bar = Text("▕")
    for (name, style, _), n in zip(SEGMENT_STYLES, _cells(amounts, width)):
        bar.append(("░" if name == "free" else "█") * n, style=style)
    bar.append("▏")
    over = seg.get("does_not_fit", 0)
    extra = 0
    if over > 0:
        extra = max(1, min(overflow, round(over * width / max(1, card["total_bytes"]))))
        bar.append("█" * extra, style="bold red")
    bar.append(" " * (overflow - extra))
    return bar


def layer_strip(plan: Mapping[str, Any], width: int = BAR_WIDTH + 12) -> Text:
    stages = plan["stages"]
    layers = plan["model"]["layers"]
    text = Text("layers ")
    if not stages:
        return text.append("(none placed)", style="red")
    cells = _cells([s["layers"][1] - s["layers"][0] for s in stages], width)
    for s, n in zip(stages, cells):
        label = f"{s['layers'][0]}-{s['layers'][1] - 1}"
        body = label.center(n) if len(label) < n else " " * n
        text.append(body, style=f"reverse {STAGE_STYLES[s['stage'] % len(STAGE_STYLES)]}")
    text.append(f"  of {layers}")
    return text


def amount(n_bytes: int) -> str:
    """``11.2 GB``, or ``360 MB`` / ``2.4 MB`` under a gigabyte: a small model's figures
    never read ``0.0 GB``."""
    if n_bytes >= 1e9:
        return wording.gb(n_bytes)
    if n_bytes == 0:
        return "0 MB"
    return f"{n_bytes / 1e6:.0f} MB" if n_bytes >= 10e6 else wording.mb(n_bytes)


def _stage_dtypes(plan: Mapping[str, Any]) -> dict[int, tuple[str, str]]:
    """Each stage's weights dtype and its reason; a plan from before stages had their
    own dtype shows the request's."""
    asked = str((plan.get("request") or {}).get("weights_dtype") or "")
    return {int(s["stage"]): (str(s.get("weights_dtype") or asked),
                              str(s.get("dtype_reason") or ""))
            for s in plan["stages"]}


def _label(card: Mapping[str, Any], most: int = 1000) -> str:
    label = wording.card_label(card["kind"], card["index"], card["name"])
    return label if len(label) <= most else label[:most - 1] + "…"


def plan_renderable(plan: Mapping[str, Any], width: int = 120) -> Group:
    """Everything ``p2pswarm plan`` prints, laid out for a terminal ``width`` wide."""
    parts: list[Any] = []
    limit = plan["layout"]["limit"]
    parts.append(Text(limit["sentence"], style="bold" if plan["fits"] else "bold red"))
    parts.append(Text(""))
    label_width = min(28, max([len(_label(c)) for c in plan["cards"]] + [8]))
    overflow = 6 if width < 100 else 12
    bar_width = max(10, min(BAR_WIDTH, width - label_width - overflow - 34))
    parts.append(layer_strip(plan, bar_width + label_width + 3))
    dtypes = _stage_dtypes(plan)
    auto = (plan.get("request") or {}).get("weights_dtype") == "auto"
    for s in plan["stages"]:
        line = Text(f"  stage {s['stage']}: layers {s['layers'][0]}-{s['layers'][1] - 1} on ")
        line.append(wording.fellows_card(s["fellow"], s["kind"], s["index"], s["name"]),
                    style=STAGE_STYLES[s["stage"] % len(STAGE_STYLES)])
        dtype, why = dtypes[int(s["stage"])]
        if dtype:  # from the network: Text, never markup; the reason where auto chose
            shown = why if auto and why else dtype
            line.append(Text(f"  {shown}", style="dim"))
        parts.append(line)
    parts.append(Text(""))

    fellow = None
    for card in plan["cards"]:
        if card["fellow_id"] != fellow:
            fellow = card["fellow_id"]
            parts.append(Text(f"{card['fellow']}", style="bold")
                         .append(f"  ({card['fellow_id']})", style="dim"))
        line = Text("  " + _label(card, label_width).ljust(label_width) + " ")
        line.append_text(card_bar(card, bar_width, overflow))
        line.append(f" {amount(card['total_bytes']):>8}  ")
        if card["used"]:
            a, b = card["layers"]
            line.append(f"layers {a}-{b - 1}", style="bold")
            dtype = dtypes.get(int(card["stage"]), ("", ""))[0] \
                if card.get("stage") is not None else ""
            if dtype:
                line.append(Text(f" {dtype}"))
        else:  # the reason is in the table below
            line.append("left out", style="dim")
        over = card["segments"]["does_not_fit"]
        if over:
            line.append(f"  {amount(over)} does not fit", style="bold red")
        parts.append(line)
    legend = Text("  ")
    state = bool(plan["model"].get("recurrent"))
    for key, style, words in SEGMENT_STYLES:
        if state and key == "kv_cache":  # a recurrent model's fixed state sits there
            words = "state"
        legend.append("░" if words == "free" else "█", style=style).append(f" {words}  ")
    legend.append("█", style="bold red").append(" does not fit")
    parts.append(legend)
    parts.append(Text(""))
    parts.append(cards_table(plan, width))
    parts.append(Text(plan["summary"]))
    parts.append(Text(f"plan_id {plan['plan_id']}", style="bold"))
    return Group(*parts)


def cards_table(plan: Mapping[str, Any], width: int = 120) -> Table:
    """Every card with its layers, segments (GB) and reason; on a narrow terminal only
    the segments that decide most (weights, KV or optimizer, other programs, free)."""
    narrow = width < 110
    train = plan["kind"] == "train"
    # megabytes when no figure reaches a gigabyte (a small model's would all read 0.0)
    largest = max((v for card in plan["cards"] for k, v in card["segments"].items()
                   if k != "free"), default=0)
    unit_bytes, unit = (1e9, "GB") if largest >= 1e9 else (1e6, "MB")
    table = Table(show_edge=False, pad_edge=False, header_style="bold", box=None,
                  title=f"segments in {unit}", title_justify="left", title_style="dim")
    table.add_column("fellow", no_wrap=True, overflow="ellipsis", max_width=12)
    table.add_column("card", no_wrap=True, overflow="ellipsis", max_width=16 if narrow else 24)
    table.add_column("layers", no_wrap=True, min_width=5)
    names = ["weights"] + ([] if narrow else ["emb/head"])
    keys = ["weights"] + ([] if narrow else ["embeddings_head_buffers"])
    if train:
        names += ["optim"] if narrow else ["activ", "optim", "lora"]
        keys += ["optimizer"] if narrow else ["activations", "optimizer", "lora"]
    else:
        kv = "state" if plan["model"].get("recurrent") else "kv"
        names += [kv] if narrow else [kv, "activ"]
        keys += ["kv_cache"] if narrow else ["kv_cache", "activations"]
    names += ["other", "free", "over"] if narrow else ["work", "other", "free", "over"]
    keys += (["other_programs", "free", "does_not_fit"] if narrow
             else ["workspace", "other_programs", "free", "does_not_fit"])
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("reason", min_width=16)

    def size(n: int) -> str:
        if not n:
            return "-"
        shown = f"{n / unit_bytes:.1f}"
        return "<0.1" if shown == "0.0" else shown

    dtypes = _stage_dtypes(plan)
    for card in plan["cards"]:
        seg = card["segments"]
        layers = f"{card['layers'][0]}-{card['layers'][1] - 1}" if card["used"] else ""
        stage = card.get("stage")
        # a used card's reason column says why its stage has its weights dtype
        reason = card["reason"] or (dtypes.get(int(stage), ("", ""))[1]
                                    if stage is not None else "")
        # names and reasons come from fellows: Text, so rich never reads them as markup
        cells: list[Any] = [Text(str(card["fellow"])), Text(_label(card)), layers]
        cells += [size(seg[k]) for k in keys[:-1]]
        over = seg["does_not_fit"]
        cells += [Text(size(over), style="bold red" if over else ""), Text(reason)]
        table.add_row(*cells)
    return table


def print_plan(plan: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_renderable(plan, console.width))


def print_any_plan(plan: Mapping[str, Any], console: Console | None = None) -> None:
    """A fleet training plan (``fleet`` in it) as its replicas, any other as a plan."""
    if "fleet" in plan:
        from p2pswarm.cli.fleet_render import print_fleet

        print_fleet(plan, console)
        return
    print_plan(plan, console)


__all__ = ["amount", "card_bar", "cards_table", "layer_strip", "plan_renderable", "print_any_plan",
           "print_plan"]
