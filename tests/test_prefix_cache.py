"""The driver's kept chat sessions: the longest shared prefix, and a kept session taken
only by a prompt that shares at least half of what it holds."""

from __future__ import annotations

import random

import pytest

from p2pswarm.agent.serving.prefix_cache import PrefixCache, common_prefix


def _one_by_one(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@pytest.mark.parametrize("a, b, shared", [
    ([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
    ([1, 2, 3], [1, 5, 3], 1), ([7], [8], 0),
    (list(range(1000)), list(range(1000)) + [5], 1000),
    (list(range(1000)), [*range(511), -1, *range(512, 1000)], 511),
    (list(range(1000)), [*range(256), -1], 256),
])
def test_common_prefix(a: list[int], b: list[int], shared: int) -> None:
    assert common_prefix(a, b) == common_prefix(tuple(b), a) == shared


def test_common_prefix_equals_a_token_by_token_scan() -> None:
    rng = random.Random(5)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 900))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3)
                                                 for _ in range(rng.randrange(0, 300))]
        assert common_prefix(a, b) == _one_by_one(a, b)


def test_a_turn_continues_its_own_chat_not_another_that_shares_its_opening() -> None:
    cache = PrefixCache()
    opening = [256, 85, 115, 101, 114, 58, 32]  # bos, "User: "
    long_chat = opening + list(range(100, 400))
    cache.put("plan", "long", long_chat, limit=4)
    # a new chat sharing the opening only: starting afresh keeps the long chat's cache
    assert cache.take("plan", opening + [9, 9, 9]) is None
    assert [k.session for k in cache.kept("plan")] == ["long"]
    # an edited last message still reuses most of the conversation
    edited = long_chat[:200] + [1, 2, 3]
    assert cache.take("plan", edited) == ("long", 200)
    assert cache.kept("plan") == ()


def test_the_next_turn_reuses_all_but_one_token_and_the_longest_wins() -> None:
    cache = PrefixCache()
    cache.put("plan", "a", [1, 2, 3, 4], limit=4)
    cache.put("plan", "b", [1, 2, 3, 4, 5, 6], limit=4)
    assert cache.take("plan", [1, 2, 3, 4, 5, 6]) == ("b", 5)  # one token left to prefill
    assert cache.take("plan", [1, 2, 3, 4, 9]) == ("a", 4)
    cache.put("plan", "c", [1], limit=4)
    assert cache.take("other-plan", [1, 2]) is None
    assert cache.take("plan", [1]) is None  # nothing would be left to prefill
