"""Admission eviction evicts the shortfall, not the whole request (issue 11, item 5).

0.5.16's ``common.evict_from_tree_cache`` on the standard (non-SWA) allocator
asks the tree for ``num_tokens`` whenever fewer than ``num_tokens`` slots are
free: with a pool of 100, 10 free and 20 to allocate it evicts 20 cached
tokens although 10 would do. The hybrid (SWA) branch already evicts only what
is missing. Here the standard branch does the same: evict
``num_tokens - available_size()``.

Why only with ``--enable-session-radix-cache``: with every flag of ours off the
patched server must behave exactly like stock 0.5.16, and this changes which
KV stays cached. The session feature is where it matters most (every extra
eviction is a session's prefix lost), so the rule rides on that flag: on when
the cache tracks sessions (``session_ref_tracker`` is set), stock otherwise.

Seam: the function is wrapped on ``sglang.srt.mem_cache.common``; its
by-name importers (``sglang.srt.mem_cache.allocation`` for
``alloc_token_slots`` / ``alloc_paged_token_slots_extend`` /
``alloc_paged_token_slots_decode`` and ``sglang.srt.managers.schedule_batch``
for ``evict_from_tree_cache`` callers there) get the wrapper through
``_wrap.rebind_imported`` when they were imported first, or through their own
from-import when they run later.
"""

from __future__ import annotations

from sglang_session_cache.patches._wrap import wrap_method


#: Per-cache decision, set once when session tracking attaches (the allocator
#: type and the chunk-cache kind never change afterwards): this runs before
#: every allocation, decode steps included, so it must cost one attribute read.
SHORTFALL_ATTR = "_session_shortfall_rule"


def shortfall_rule_applies(tree_cache) -> bool:
    """The session flag is on for this cache and it has a standard allocator."""
    if tree_cache is None or getattr(tree_cache, "session_ref_tracker", None) is None:
        return False
    if tree_cache.is_chunk_cache():
        return False
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    # The hybrid branch of 0.5.16 already evicts the shortfall per pool.
    return not isinstance(tree_cache.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)


def _wrap_evict_from_tree_cache(orig):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def evict_from_tree_cache(tree_cache, num_tokens):
        if not getattr(tree_cache, SHORTFALL_ATTR, False):
            return orig(tree_cache, num_tokens)
        shortfall = num_tokens - tree_cache.token_to_kv_pool_allocator.available_size()
        if shortfall > 0:
            tree_cache.evict(EvictParams(num_tokens=shortfall))

    return evict_from_tree_cache


def apply_common(module) -> None:
    wrap_method(module, "evict_from_tree_cache", _wrap_evict_from_tree_cache)
