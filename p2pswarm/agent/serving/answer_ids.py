"""The token ids of the answers a driver gave, so a chat that resends them as text
prefills none of them again.

A chat client keeps its conversation as text and resends it every turn. An answer's text
does not always encode back to the ids the model drew (a byte-level model's random bytes,
or a BPE that would merge differently), and the kept session's cache (``prefix_cache``)
then covers the conversation only up to where the ids part. So the driver notes each
remembered answer's text and ids, and encodes a chat prompt in pieces: every noted answer
found in it becomes its own ids, the text between is encoded as usual. The same
conversation then always encodes to the same ids, and a turn's ids begin with the ids the
turn before held: the cached prefix covers all but the new message.

An answer is noted only when its ids decode to exactly its text, so a substitution never
changes what the prompt says. Bounded per load (least recently used go first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

ANSWERS_KEPT = 64  # answers noted per load (a few conversations' last turns)
MIN_ANSWER_CHARS = 4  # shorter answers are left to the tokenizer (they would match anywhere)


class AnswerIds:
    def __init__(self) -> None:
        self._answers: dict[str, OrderedDict[str, tuple[int, ...]]] = {}

    def note(self, plan_id: str, tokenizer: Any, text: str, ids: Sequence[int]) -> None:
        """Note an answer the driver produced (only one whose ids decode to its text)."""
        if len(text) < MIN_ANSWER_CHARS or not ids or tokenizer.decode(list(ids)) != text:
            return
        answers = self._answers.setdefault(plan_id, OrderedDict())
        answers[text] = tuple(ids)
        answers.move_to_end(text)
        while len(answers) > ANSWERS_KEPT:
            answers.popitem(last=False)

    def encode(self, plan_id: str, tokenizer: Any, prompt: str) -> list[int]:
        """``prompt``'s ids: noted answers in it as their own ids, the rest encoded."""
        answers = self._answers.get(plan_id)
        if not answers:
            return list(tokenizer.encode(prompt))
        ids: list[int] = []
        start = 0  # where the text not yet encoded begins
        at = 0  # where to look for the next answer
        while True:
            found = _next_answer(prompt, at, answers)
            if found is None:
                break
            where, text = found
            answers.move_to_end(text)
            if where > start or start == 0:
                ids += tokenizer.encode(prompt[start:where], add_bos=start == 0)
            ids += answers[text]
            start = at = where + len(text)
        if start < len(prompt):
            ids += tokenizer.encode(prompt[start:], add_bos=start == 0)
        return ids


def _next_answer(prompt: str, at: int, answers: OrderedDict[str, tuple[int, ...]]
                 ) -> tuple[int, str] | None:
    """The first noted answer in ``prompt`` from ``at`` (the longest where several start
    at the same place)."""
    best: tuple[int, str] | None = None
    for text in answers:
        where = prompt.find(text, at)
        if where < 0:
            continue
        if best is None or where < best[0] or (where == best[0] and len(text) > len(best[1])):
            best = (where, text)
    return best


__all__ = ["ANSWERS_KEPT", "AnswerIds"]
