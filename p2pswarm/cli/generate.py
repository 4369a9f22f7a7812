"""Using a load: generate (continue a prompt, streaming tokens, then speed per stage) and
chat (a line is a turn: the conversation goes through the model's chat template, and the
stages keep the session's cache between turns, so only the new turn is prefilled)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from p2pswarm.cli.app import HomeOption, JsonOption, app, print_json, printable
from p2pswarm.cli.exits import exits_on, fail
from p2pswarm.cli.local_agent import stream_agent
from p2pswarm.control.requests import request_map
from p2pswarm.wire.control import ChatRequest, ChatTurn, GenerateRequest

_GENERATE_TIMEOUT_S = 180.0  # the most a `generate` waits between two tokens


def _print_generation_stats(result: dict[str, Any]) -> None:
    n = len(result.get("token_ids", []))
    typer.echo(f"\n{n} tokens ({result.get('stop_reason')}); first after "
               f"{result.get('time_to_first_token_s', 0):.2f} s for {result.get('prompt_tokens')}"
               f" prompt tokens; then {result.get('decode_tokens_per_s', 0):.1f} tokens/s",
               err=True)
    parts = [f"stage {s['stage']} {s['fellow']} (layers {s['layers'][0]}-{s['layers'][1] - 1}) "
             f"{s['ms_per_token']:.1f} ms" for s in result.get("stages", [])]
    typer.echo("per token: " + ", ".join(parts)
               + f", network {result.get('network_ms_per_token', 0):.1f} ms over "
               f"{result.get('hops')} hops", err=True)


def _generate_once(home: Optional[Path], prompt: str | list[int], options: GenerateRequest,
                   as_json: bool) -> dict[str, Any]:
    asked = dataclasses.replace(options, prompt_ids=tuple(prompt)) if isinstance(prompt, list) \
        else dataclasses.replace(options, prompt=prompt)
    return _stream_op(home, request_map("generate", asked), as_json)


def _stream_op(home: Optional[Path], request: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """Run a generating op, its text to standard output as it comes; a wait in the
    load's queue is said once on standard error."""
    told: list[int] = []

    def on_event(event: dict[str, Any]) -> None:
        ahead = event.get("queued")
        if isinstance(ahead, int) and not told:
            told.append(ahead)
            typer.echo(f"waiting for a session slot: {ahead} ahead in the queue", err=True)
        if not as_json and isinstance(event.get("text"), str):
            sys.stdout.write(printable(event["text"]))
            sys.stdout.flush()

    return stream_agent(home, request, on_event, _GENERATE_TIMEOUT_S)  # type: ignore[no-any-return]


def _prompt_ids(text: str) -> list[int]:
    """``1,17,258`` as token ids."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        fail(f"--prompt-ids {text[:40]!r}: give token ids separated by commas, e.g. 1,17,258")
    if not ids or min(ids) < 0:
        fail("--prompt-ids needs at least one token id, none negative, e.g. 1,17,258")
    return ids


def _generate_options(max_tokens: int, temperature: float, top_k: int, top_p: float,
                      seed: int, plan_id: Optional[str]) -> GenerateRequest:
    """How to draw: a generate request with no prompt yet."""
    if max_tokens <= 0:
        fail(f"--max-tokens {max_tokens} must be positive, e.g. --max-tokens 64")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        fail("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    return GenerateRequest(plan_id=plan_id or "", max_tokens=max_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


MaxTokensOption = typer.Option(64, "--max-tokens", help="The most new tokens.")
TemperatureOption = typer.Option(0.0, "--temperature", help="0: greedy; else sample.")
TopKOption = typer.Option(0, "--top-k", help="Sample among the k likeliest (0: all).")
TopPOption = typer.Option(1.0, "--top-p", help="Sample within this probability mass.")
SeedOption = typer.Option(0, "--seed", help="Seed of the sampler (same seed, same text).")
PlanIdOption = typer.Option(None, "--plan-id", help="Which load (default: the only one).")


@app.command()
@exits_on()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The text to continue."),
    prompt_ids: Optional[str] = typer.Option(
        None, "--prompt-ids", help="Continue these token ids instead of a text (1,17,258): "
        "for a model without a tokenizer."),
    max_tokens: int = MaxTokensOption,
    temperature: float = TemperatureOption,
    top_k: int = TopKOption,
    top_p: float = TopPOption,
    seed: int = SeedOption,
    plan_id: Optional[str] = PlanIdOption,
    home: Optional[Path] = HomeOption,
    as_json: bool = JsonOption,
) -> None:
    """Continue PROMPT with the loaded model, streaming tokens; then tokens/s per stage."""
    options = _generate_options(max_tokens, temperature, top_k, top_p, seed, plan_id)
    if (prompt is None) == (prompt_ids is None):
        fail("give a PROMPT text or --prompt-ids 1,17,258, one of the two")
    given: str | list[int] = _prompt_ids(prompt_ids) if prompt_ids is not None else str(prompt)
    try:
        result = _generate_once(home, given, options, as_json)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    if as_json:
        print_json(result)
        return
    _print_generation_stats(result)


@app.command()
@exits_on()
def chat(
    max_tokens: int = MaxTokensOption,
    temperature: float = TemperatureOption,
    top_k: int = TopKOption,
    top_p: float = TopPOption,
    seed: int = SeedOption,
    plan_id: Optional[str] = PlanIdOption,
    turns: int = typer.Option(0, "--turns", help="Earlier turns kept in the prompt (0: all "
                              "that fit the load's context)."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message first."),
    home: Optional[Path] = HomeOption,
) -> None:
    """Talk with the loaded model: each line you type is a turn (EOF or Ctrl-D ends)."""
    options = _generate_options(max_tokens, temperature, top_k, top_p, seed, plan_id)
    if turns < 0:
        fail(f"--turns {turns} must be 0 (all that fit) or more")
    history: list[ChatTurn] = []  # user and assistant messages, in order
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("> ", nl=False)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        recent = history[-2 * turns:] if turns else history
        messages = ([ChatTurn("system", system)] if system else []) + recent \
            + [ChatTurn("user", line)]
        turn = ChatRequest(tuple(messages), options)
        try:
            result = _stream_op(home, request_map("chat", turn), False)
        except KeyboardInterrupt:
            typer.echo("\ninterrupted", err=True)
            continue
        typer.echo("")
        history += [ChatTurn("user", line), ChatTurn("assistant", str(result.get("text", "")))]
    if interactive:
        typer.echo("")
