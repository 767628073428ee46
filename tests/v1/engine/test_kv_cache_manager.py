"""GPU block tables over one pool per KV-cache group."""

from __future__ import annotations

from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, 4, block_hasher=get_request_block_hasher(8))


def test_prefix_hits_are_aligned_and_never_cover_the_last_token() -> None:
    kv = KVCacheManager(16, (8, 16), hash_block_size=8)
    a = _request("a", list(range(48)))
    assert kv.allocate_slots(a, 48) is not None
    kv.free(a)
    blocks, tokens = kv.get_computed_blocks(_request("b", list(range(48))))
    assert tokens == 32  # 48 tokens cached, capped below the last token, aligned to 16
    assert [len(g) for g in blocks] == [4, 2]
    _, tokens = kv.get_computed_blocks(_request("c", [*range(20), 7, *range(21, 48)]))
    assert tokens == 16  # diverges inside the second 16-token block


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(4, (16,), hash_block_size=16)
    a = _request("a", list(range(40)))
    assert kv.allocate_slots(a, 40) == ([0, 1, 2],)
    b = _request("b", list(range(100, 140)))
    assert kv.allocate_slots(b, 40) is None
    assert kv.pools[0].num_free_blocks == 1 and kv.get_block_ids("b") == ([],)
    a.num_computed_tokens = 40
    assert kv.allocate_slots(a, 9) == ([3],)
    assert kv.usage() == 1.0
    kv.free(a)
    assert kv.pools[0].num_free_blocks == 4


def test_delayed_caching_registers_blocks_only_when_asked() -> None:
    kv = KVCacheManager(8, (16,), hash_block_size=16)
    a = _request("a", list(range(64)))
    kv.allocate_slots(a, 0, num_external_computed_tokens=48, delay_cache_blocks=True)
    assert kv.get_computed_blocks(_request("b", list(range(64))))[1] == 0
    kv.cache_blocks(a, 32)
    assert kv.get_computed_blocks(_request("c", list(range(64))))[1] == 32
