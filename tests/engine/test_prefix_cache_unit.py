"""Unit tests of the dev engine's prefix cache index (devkit/dev_server/prefix_cache.py).

Contract: the longest held prefix is found (capped by ``max_reuse``), a private copy cropped to it is returned
(the held entry is never mutated), an entry that is a prefix of a newly stored prompt is dropped, the total
of held prompt tokens never exceeds ``max_tokens`` (least recently used out first), 0 disables it.
The KV object here is a stand-in with the one method the index uses (``crop``).
"""

from __future__ import annotations

import pytest

from devkit.dev_server.prefix_cache import PrefixCache, common_prefix_len

pytestmark = pytest.mark.unit


class KV:
    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)

    def crop(self, tokens_to_remove: int) -> None:  # transformers: a negative count removes that many
        assert tokens_to_remove < 0
        del self.ids[tokens_to_remove:]


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ((), (1,), 0),
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2), 2),
        ((1, 2, 3), (1, 5, 3), 1),
        ((9,), (1,), 0),
        (tuple(range(100)), tuple(range(57)) + (0,), 57),
    ],
)
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == n
    assert common_prefix_len(b, a) == n


def test_lookup_longest_prefix_private_copy():
    c = PrefixCache(100)
    c.store([1, 2, 3, 4], KV([1, 2, 3, 4]))
    c.store([1, 2, 9, 9, 9], KV([1, 2, 9, 9, 9]))
    n, kv = c.lookup([1, 2, 3, 4, 5, 6], max_reuse=5)
    assert n == 4 and kv is not None and kv.ids == [1, 2, 3, 4]
    n, kv = c.lookup([1, 2, 3, 7], max_reuse=3)
    assert n == 3 and kv.ids == [1, 2, 3]
    kv.ids.append(42)  # the caller extends its copy; the held entry stays as stored
    n, kv = c.lookup([1, 2, 3, 4], max_reuse=3)  # max_reuse = len - 1: the last token is always computed
    assert n == 3 and kv.ids == [1, 2, 3]
    assert c.lookup([7, 7], max_reuse=1) == (0, None)
    assert c.lookup([1, 2, 3], max_reuse=0) == (0, None)


def test_prefix_entry_replaced_and_token_bound():
    c = PrefixCache(10)
    c.store([1, 2, 3], KV([1, 2, 3]))
    c.store([1, 2, 3, 4, 5], KV([1, 2, 3, 4, 5]))  # [1, 2, 3] is a prefix of it: dropped
    assert len(c) == 1 and c.tokens == 5
    c.store([8, 8, 8, 8], KV([8] * 4))
    assert c.tokens == 9
    c.lookup([1, 2, 3, 4, 5, 6], max_reuse=5)  # touch: [8,8,8,8] is now the least recently used
    c.store([6, 6], KV([6, 6]))
    assert c.tokens <= 10 and len(c) == 2
    assert c.lookup([8, 8, 8, 8, 1], max_reuse=4) == (0, None)
    assert c.lookup([1, 2, 3, 4, 5, 1], max_reuse=5)[0] == 5
    c.store(list(range(11)), KV(list(range(11))))  # longer than the whole budget: not held
    assert c.lookup(list(range(11)), max_reuse=10) == (0, None)
    c.clear()
    assert len(c) == 0 and c.tokens == 0


def test_disabled():
    c = PrefixCache(0)
    c.store([1, 2, 3], KV([1, 2, 3]))
    assert c.lookup([1, 2, 3, 4], max_reuse=3) == (0, None) and len(c) == 0


class WindowKV(KV):
    """Like a transformers sliding-window layer past its window: it can extend but not roll back."""

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("cannot crop past the sliding window")


def test_uncroppable_kv_is_a_miss_but_a_whole_prefix_is_reused() -> None:
    cache = PrefixCache(100)
    cache.store([1, 2, 3, 4], WindowKV([1, 2, 3, 4]))
    assert cache.lookup([1, 2, 9], 10) == (0, None)
    n, kv = cache.lookup([1, 2, 3, 4, 5], 10)
    assert n == 4 and kv is not None and kv.ids == [1, 2, 3, 4]
