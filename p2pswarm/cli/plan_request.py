"""What a plan asks for, as options shared by `plan`, `load` and `train`."""

from __future__ import annotations

import typer

from p2pswarm.cli.exits import fail

ContextOption = typer.Option(None, "--context", help="Context tokens per sequence (default: "
                             "4096 or the model's maximum).")
SequencesOption = typer.Option(1, "--sequences", help="Sequences decoded together.")
StagesOption = typer.Option(None, "--stages", help="Fix the number of stages.")
WeightsDtypeOption = typer.Option(
    None, "--weights-dtype", help="auto, f32, f16, bf16, int8 or int4. Default to serve: auto "
    "(each stage keeps f16 where its card holds it, else int8, then int4); to train: bf16.")
KvDtypeOption = typer.Option("f16", "--kv-dtype", help="f32, f16, bf16 or int8.")
ExcludeOption = typer.Option([], "--exclude", help="Leave a card out: FELLOW:INDEX or "
                             "FELLOW:cpu (repeatable).")
FloorOption = typer.Option([], "--floor", help="Least free memory a card needs, per kind: "
                           "cuda=2GB, cpu=1GB (repeatable).")


def floors(items: list[str]) -> dict[str, str]:
    """--floor KIND=SIZE items as the request's ``floors_bytes``."""
    out = {}
    for item in items:
        kind, sep, size = item.partition("=")
        if not sep or kind not in ("cuda", "cpu") or not size:
            fail(f"--floor {item!r} must be KIND=SIZE with KIND cuda or cpu, e.g. cuda=2GB")
        out[kind] = size
    return out


__all__ = ["ContextOption", "ExcludeOption", "FloorOption", "KvDtypeOption", "SequencesOption",
           "StagesOption", "WeightsDtypeOption", "floors"]
