"""Session-aware eviction for the unified tree.

* FULL keeps SGLang's leaf heap; its key changes, to ``(is_referenced,
  session_ref, configured policy priority)``.  With the default LRU policy
  the heap is kept across evictions (``full_leaf_heap``) instead of rebuilt
  per call as in 0.5.16; it evicts the same leaves.
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

from sglang_session_cache.full_leaf_heap import FullLeafHeap, make_leaf_set_update


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
        refs = cache.session_ref_tracker
        full = refs.components.get(self.component_type) if refs is not None else None
        heap = cache._session_leaf_heap
        if full is not None and heap is not None:
            # LRU keys only grow but for counts going down, which ``full``
            # records: the heap is kept across calls (full_leaf_heap.py).
            heap.drive(cache.evictable_device_leaves, full.lowered,
                       cache._evict_device_leaf, params.num_tokens, tracker,
                       self.component_type)
            return
        if full is not None:
            full.lowered.clear()  # only the kept heap reads it
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


def keep_leaf_heap(cache) -> bool:
    """Give a session cache (this instance) a FULL leaf heap kept across
    evictions, which its FULL component drives, and the leaf-set update that
    feeds it.  Only under the default ``lru`` policy (its keys only grow);
    others rebuild per call as 0.5.16 does."""
    import types

    full = cache.components.get(ComponentType.FULL)
    if (not isinstance(full, SessionAwareFullComponent)
            or type(cache.eviction_strategy) is not LRUStrategy):
        return False
    heap = FullLeafHeap()
    update = make_leaf_set_update(type(cache), heap)
    if update is None:
        return False
    cache._update_evictable_leaf_sets = types.MethodType(update, cache)
    # FULL's drive and the cache's leaf deletions both reach it here.
    cache._session_leaf_heap = heap
    return True


def make_device_leaf_evictor(cache_cls):
    """``_evict_device_leaf`` for a session cache (installed on the instance
    by ``attach_session_tracking``; a cache without sessions keeps SGLang's
    own method untouched).

    The write-through case, in which the leaf is deleted whole, is 0.5.16's
    code with the session hooks in line: the breach counters and ghosts of
    the ``_evict_component_and_detach_lru`` hook, and the deletion hook of
    ``_remove_leaf_from_parent``, around SGLang's own (unwrapped) methods.
    Every deleted leaf comes here, and the three wrapper calls this saves are
    a measurable part of an eviction on a referenced tree.  A backed-up leaf
    (demoted to host) and write-back HiCache take SGLang's path, hooks
    included.  None where ``cache_cls`` overrides the hooked methods."""
    from sglang.srt.disaggregation.kv_events import StorageMedium

    from sglang_session_cache.patches.unified_cache import guarded

    stock = cache_cls._evict_device_leaf
    evict_component = getattr(cache_cls._evict_component_and_detach_lru, "__wrapped__", None)
    remove_leaf = getattr(cache_cls._remove_leaf_from_parent, "__wrapped__", None)
    if evict_component is None or remove_leaf is None:
        return None  # a subclass replaced the hooked methods: its path stays
    both, gpu = EvictLayer.ALL, StorageMedium.GPU
    full_ct = ComponentType.FULL

    def _evict_device_leaf(self, node, tracker):
        refs = self.session_ref_tracker
        controller = self.cache_controller
        if refs is None or node.backuped or (
            controller is not None and controller.write_policy == "write_back"
        ):
            return stock(self, node, tracker)
        assert self._is_device_leaf(node), f"node {node.id} is not a D-leaf"
        self._record_remove_event(node, medium=gpu)
        cds = node.component_data
        for comp in self._components_tuple:
            ct = comp.component_type
            cd = cds[ct]
            if cd.session_ref:
                # A soft-protection breach, counted if device data went.
                freed = evict_component(self, node, comp, both, tracker)
                if freed[0]:
                    counts = refs.breaches[ct]
                    counts[0] += 1
                    counts[1] += freed[0]
                continue
            if ct == full_ct and refs.policy.scale.capacity and cd.value is not None:
                # Unreferenced KV going: a ghost for the learned protection
                # scale (as in the component hook).
                guarded(refs.on_unreferenced_evict, node)
            evict_component(self, node, comp, both, tracker)
        self.evictable_device_leaves.discard(node)
        parent = node.parent
        refs.on_node_deleted(node)
        remove_leaf(self, node)
        heap = self._session_leaf_heap
        if heap is not None:
            heap.forget(node)
        self._update_evictable_leaf_sets(parent)
        self._iteratively_delete_tombstone_leaf(node, tracker)

    return _evict_device_leaf


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
    it never resumes from a stale position.  The first pass protects (see
    ``cascade_blocked``); a second, unprotected one runs only if the first
    freed too little."""
    ct = component.component_type
    if tracker[ct] >= request:
        return
    cache = component.cache
    lru = cache.lru_lists[ct]
    leaves = cache.evictable_device_leaves
    protect = True
    x = lru.get_lru_no_lock()
    while True:
        while x is not None:
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
            if tracker[ct] >= request:
                return
            if lru.moves != moves or (x_next is not None and x_next.id not in lru.cache):
                x = lru.get_lru_no_lock()
            else:
                x = x_next
        if not protect:
            return
        protect = False
        x = lru.get_lru_no_lock()


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
