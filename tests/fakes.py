"""Stand-ins shared by the tests: an agent behind the control client."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from p2pswarm.control.requests import decoded

M = TypeVar("M")

# what a load of small-llama on three fellows answers (a load record)
RECORD = {"plan_id": "0123456789abcdef", "model": {"kind": "builtin", "name": "small-llama"},
          "load_s": 1.5, "stages": [
              {"stage": i, "fellow": f"fellow-{i + 1}", "fellow_id": f"{i:02x}", "addr": "x:1",
               "layers": [4 * i, 4 * i + 4], "card": "CPU", "claim_bytes": 59_000_000,
               "allocated_bytes": 59_000_000, "fetched_bytes": 0, "state": "alive"}
              for i in range(3)], "complete": True}


_OPS = {"LoadRequest": "load", "LoadCancelRequest": "load_cancel", "LoadsRequest": "loads",
        "UnloadRequest": "unload", "LoadMoveRequest": "load_move",
        "GenerateRequest": "generate", "ChatRequest": "chat"}


class FakeAgent:
    """Answers control requests as the agent would, and records them."""

    def __init__(self, answers: dict[str, Any], events: dict[str, list[Any]] | None = None
                 ) -> None:
        self.answers = answers
        self.events = events or {}
        self.requests: list[dict[str, Any]] = []

    def sent(self, kind: type[M]) -> list[M]:
        """The typed requests of ``kind`` a client sent (encoded, as the CLI sends them)."""
        return [decoded(r["msg"], kind) for r in self.requests
                if isinstance(r.get("msg"), bytes) and r["op"] == _OPS.get(kind.__name__)]

    def request(self, home: Path, req: dict[str, Any], timeout_s: float = 30.0) -> Any:
        return self.stream(home, req, lambda e: None, timeout_s)

    def stream(self, home: Path, req: dict[str, Any], on_event: Any,
               timeout_s: float = 30.0) -> Any:
        self.requests.append(req)
        for event in self.events.get(req["op"], []):
            on_event(event)
        answer = self.answers[req["op"]]
        if isinstance(answer, Exception):
            raise answer
        return answer(req) if callable(answer) else answer
