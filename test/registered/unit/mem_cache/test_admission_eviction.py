"""Admission eviction evicts the shortfall with --enable-session-radix-cache
(issue 11 item 5), on the real FULL-only cache and the real
``TokenToKVPoolAllocator``: pool 100, 10 free, allocate 20 -> 10 cached tokens
evicted with the flag, 20 without (stock 0.5.16)."""

import pytest
from cache_fixtures import make_full_cache, make_swa_cache

from sglang.srt.managers import schedule_batch
from sglang.srt.mem_cache import allocation, common
from sglang_session_cache.activation import applied_patches
from sglang_session_cache.patches._wrap import PATCHED_FLAG


def _filled(enable_session: bool, num_tokens: int = 100, page_size: int = 1):
    """A cache whose pool is full of unreferenced cached KV except 10 slots."""
    h = make_full_cache(num_tokens=num_tokens, page_size=page_size,
                        enable_session=enable_session)
    base = 1000
    while h.allocator.available_size() > 10:
        n = min(10, h.allocator.available_size() - 10)
        h.run_request([base + i for i in range(n)])
        base += 100
    assert h.allocator.available_size() == 10
    assert h.cache.full_evictable_size() == num_tokens - 10
    return h


def test_patch_installed_for_every_by_name_importer():
    assert "common.admission_shortfall_eviction" in applied_patches()
    assert getattr(common.evict_from_tree_cache, PATCHED_FLAG, False)
    assert allocation.evict_from_tree_cache is common.evict_from_tree_cache
    assert schedule_batch.evict_from_tree_cache is common.evict_from_tree_cache


@pytest.mark.parametrize("enable_session,evicted", [(True, 10), (False, 20)],
                         ids=["flag_on", "flag_off"])
def test_alloc_token_slots_evicts_the_shortfall(enable_session, evicted):
    h = _filled(enable_session)
    before = h.cache.full_evictable_size()
    out = allocation.alloc_token_slots(h.cache, 20)  # the scheduler's admission call
    assert out is not None and len(out) == 20
    assert before - h.cache.full_evictable_size() == evicted
    assert h.allocator.available_size() == evicted - 10
    h.allocator.free(out)
    h.check()


@pytest.mark.parametrize("enable_session", [True, False], ids=["flag_on", "flag_off"])
def test_enough_free_evicts_nothing(enable_session):
    h = _filled(enable_session)
    before = h.cache.full_evictable_size()
    common.evict_from_tree_cache(h.cache, 10)
    assert h.cache.full_evictable_size() == before


def test_flag_off_is_the_original_call():
    # Stock semantics: the original function, same arguments, same result.
    h1, h2 = _filled(False), _filled(False)
    common.evict_from_tree_cache.__wrapped__(h1.cache, 20)
    common.evict_from_tree_cache(h2.cache, 20)
    assert h1.cache.full_evictable_size() == h2.cache.full_evictable_size() == 70


def test_swa_allocator_keeps_sglangs_per_pool_shortfall():
    # The hybrid branch already evicts the shortfall; the wrapper leaves it alone.
    h = make_swa_cache(num_tokens=64, page_size=1, enable_session=True)
    h.run_request(list(range(1, 41)))
    free = h.allocator.full_available_size()
    before = h.cache.full_evictable_size()
    common.evict_from_tree_cache(h.cache, free + 4)
    assert before - h.cache.full_evictable_size() >= 4
    assert h.allocator.full_available_size() >= free + 4
    h.check()
