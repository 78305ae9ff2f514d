"""Session-aware eviction for the unified tree.

* FULL keeps SGLang's leaf heap (rebuilt per eviction, as in 0.5.16); only its
  key changes, to ``(is_referenced, session_ref, configured policy priority)``.
* SWA and Mamba keep their LRU walks over a ``PartitionedLRUList``; the walk
  parks a cursor sentinel in front of each victim so it can continue after the
  eviction reshuffled the list, and it skips nodes whose eviction would take a
  referenced component of equal or higher priority along (cascade protection).
  If that pass frees too little, a second pass without the protection runs:
  references are soft.

The component classes are supplied through ``CacheInitParams.
component_registry_override`` only when ``--enable-session-radix-cache`` is on.
"""

from __future__ import annotations

import heapq

from sglang.srt.mem_cache.evict_policy import LRUStrategy
from sglang.srt.mem_cache.unified_cache_components import (
    ComponentType,
    EvictLayer,
    FullComponent,
    MambaComponent,
    SWAComponent,
)


def _full_heap_drive(component, leaves: set, evict_leaf, request: int, tracker: dict) -> None:
    """SGLang's FULL leaf-heap loop with the session key.

    The key is ``(is_referenced, session_ref, policy priority)``.  Because
    ``session_ref`` is a non-negative count, ``is_referenced`` is implied by it,
    so the heap stores the order-identical flat ``(session_ref, priority, node)``
    — one extra int compared per step — reading the count mirrored on the node
    (``full_session_ref``) so building the heap touches no extra objects."""
    strategy = component.cache.eviction_strategy
    get_priority = strategy.get_priority
    ct = component.component_type
    if type(strategy) is LRUStrategy:
        # The default policy's priority is the attribute itself: read it
        # directly instead of one method call per leaf on a rebuild that is
        # O(leaves) every eviction (same values, so the same order).
        heap = [(n.full_session_ref, n.last_access_time, n) for n in leaves]
    else:
        heap = [(n.full_session_ref, get_priority(n), n) for n in leaves]
    heapq.heapify(heap)
    while tracker[ct] < request and heap:
        x = heapq.heappop(heap)[2]
        if x not in leaves:
            continue
        evict_leaf(x, tracker)
        parent = x.parent
        if parent is not None and parent in leaves:
            heapq.heappush(
                heap,
                (parent.full_session_ref, get_priority(parent), parent),
            )


def full_eviction_key(cache, node):
    """The FULL eviction key as the design states it (used by tests/docs)."""
    ref = node.component_data[0].session_ref
    return (ref > 0, ref, cache.eviction_strategy.get_priority(node))


class SessionAwareFullComponent(FullComponent):
    def commit_insert_component_data(self, node, is_new_leaf, params, result):
        # The insert walk ends on ``node``: a finishing request's session
        # reference goes here (cache_finished_req opens the capture).  Later
        # SWA splits keep ``node`` as the lower, leaf-end part.
        capture = self.cache._session_insert_capture
        if capture is not None:
            capture.append(node)
        return super().commit_insert_component_data(node, is_new_leaf, params, result)

    def drive_eviction(self, params, tracker):
        cache = self.cache
        _full_heap_drive(
            self, cache.evictable_device_leaves, cache._evict_device_leaf,
            params.num_tokens, tracker,
        )

    def drive_host_eviction(self, num_tokens, tracker):
        cache = self.cache
        _full_heap_drive(
            self, cache.evictable_host_leaves, cache._evict_host_leaf,
            num_tokens, tracker,
        )


def cascade_blocked(cache, node, trigger, host: bool = False) -> bool:
    """Would evicting ``trigger``'s data on ``node`` (its host copy with
    ``host``) drop a referenced component whose own (internal) priority is at
    least the trigger's, while the trigger's data itself is unreferenced?"""
    cds = node.component_data
    if cds[trigger.component_type].session_ref > 0:
        return False
    layer = None
    for comp in cache._components_tuple:
        if comp is trigger or cds[comp.component_type].session_ref <= 0:
            continue  # only a referenced component can block
        if layer is None:  # the node's leaf state, once, when it matters
            if host:
                is_leaf = node in cache.evictable_host_leaves
                layer = EvictLayer.HOST
            else:
                is_leaf = node in cache.evictable_device_leaves
                layer = EvictLayer.DEVICE
            trigger_internal = trigger.eviction_priority(is_leaf=False)
            trigger_now = trigger.eviction_priority(is_leaf)
        if comp.eviction_priority(is_leaf) > trigger_now:
            continue  # not taken along by this eviction
        if comp.eviction_priority(is_leaf=False) < trigger_internal:
            continue  # lower tier: cascading it is the normal rule
        if comp.node_has_component_data(node, layer):
            return True
    return False


def _drive_lru_eviction(component, request: int, tracker: dict) -> None:
    """Device eviction walk shared by the SWA and Mamba components.

    Like SGLang's walk it takes the next candidate before evicting; when the
    eviction unlinked it or moved any node between partitions (a reference
    relocating to a parent), the walk restarts from the LRU end instead, so
    it never resumes from a stale position."""
    cache = component.cache
    ct = component.component_type
    lru = cache.lru_lists[ct]
    leaves = cache.evictable_device_leaves
    for protect in (True, False):
        if tracker[ct] >= request:
            return
        x = lru.get_lru_no_lock()
        while tracker[ct] < request and x is not None:
            if (
                protect
                and not x.component_data[ct].session_ref
                and cascade_blocked(cache, x, component)
            ):
                x = lru.get_prev_no_lock(x, check_id=False)
                continue
            x_next = lru.get_prev_no_lock(x, check_id=False)
            moves = lru.moves
            if x in leaves:
                # D-leaf: atomic eviction of all components
                cache._evict_device_leaf(x, tracker)
            else:
                # Internal: tombstone this component + cascade
                cache._evict_component_and_detach_lru(
                    x, component, target=EvictLayer.DEVICE, tracker=tracker
                )
                cache._cascade_evict(x, component, tracker)
            if lru.moves != moves or (x_next is not None and x_next.id not in lru.cache):
                x = lru.get_lru_no_lock()
            else:
                x = x_next


def _drive_host_lru_eviction(component, num_tokens: int, tracker: dict) -> None:
    """Host (HiCache) eviction walk shared by the SWA and Mamba components,
    with the same two passes as the device walk: the first skips host copies
    whose eviction would take a referenced component along (an H-leaf goes
    whole, FULL host KV included)."""
    cache = component.cache
    ct = component.component_type
    host_lru = cache.host_lru_lists[ct]
    for protect in (True, False):
        if tracker[ct] >= num_tokens:
            return
        x = host_lru.get_lru_no_host_lock()
        try:
            while tracker[ct] < num_tokens and x is not None:
                if (
                    protect
                    and not x.component_data[ct].session_ref
                    and cascade_blocked(cache, x, component, host=True)
                ):
                    x = host_lru.get_prev_no_host_lock(x, check_id=False)
                    continue
                host_lru.park_cursor_before(x)
                if x in cache.evictable_host_leaves:
                    cache._evict_host_leaf(x, tracker)
                else:
                    cache._evict_component_and_detach_lru(
                        x, component, target=EvictLayer.HOST, tracker=tracker
                    )
                    cache._cascade_evict(x, component, tracker, target=EvictLayer.HOST)
                x = host_lru.next_from_cursor(host=True)
        finally:
            host_lru.detach_cursor()


class SessionAwareSWAComponent(SWAComponent):
    def drive_eviction(self, params, tracker):
        _drive_lru_eviction(self, params.swa_num_tokens, tracker)

    def drive_host_eviction(self, num_tokens, tracker):
        _drive_host_lru_eviction(self, num_tokens, tracker)


class SessionAwareMambaComponent(MambaComponent):
    def drive_eviction(self, params, tracker):
        _drive_lru_eviction(self, params.mamba_num, tracker)

    def drive_host_eviction(self, num_tokens, tracker):
        _drive_host_lru_eviction(self, num_tokens, tracker)


SESSION_COMPONENT_REGISTRY = {
    ComponentType.FULL: SessionAwareFullComponent,
    ComponentType.SWA: SessionAwareSWAComponent,
    ComponentType.MAMBA: SessionAwareMambaComponent,
}
