"""The seeded source of randomness the pure machines draw from, as a Protocol.

The machines take their randomness injected (a seeded ``random.Random`` in a harness,
so runs reproduce), and the pure-core contract forbids them the ``random`` module, the
global one included. Typing the injected source by this Protocol, not by
``random.Random``, keeps even their type-checking imports clear of ``random``, so the
layer contracts can count ``TYPE_CHECKING`` imports. ``random.Random`` satisfies it.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Rng(Protocol):
    """The draws the machines make (``random.Random``'s methods of the same names)."""

    def random(self) -> float: ...

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int: ...

    def randint(self, a: int, b: int) -> int: ...

    def choice(self, seq: Sequence[T]) -> T: ...

    def sample(self, population: Sequence[T], k: int) -> list[T]: ...

    def shuffle(self, x: MutableSequence[Any]) -> None: ...


__all__ = ["Rng"]
