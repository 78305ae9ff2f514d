"""Session references on ``UnifiedRadixCache`` (tree side).

Everything here is inert unless the cache was built with
``CacheInitParams.enable_session_radix_cache=True``: the wrappers check
``self.session_ref_tracker`` (a class-level ``None``) and fall straight through
to SGLang's own code otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types

from sglang_session_cache.patches._wrap import add_method, wrap_method

logger = logging.getLogger("sglang.srt.mem_cache.unified_radix_cache")


def share_instance_keys(cls, names) -> None:
    """Enter ``names`` (class attributes already) into ``cls``'s shared
    instance-key table now, while it has room.

    CPython 3.11+ keeps most instances' attributes inline, indexed by one key
    table per class; every new instance shrinks the room that table keeps for
    names first set after construction, down to a single name.  A node gets
    our fields late (when it is listed or referenced), so past that point
    setting a second one turned the node's attributes into a real dict, and
    every attribute read on it -- SGLang's own tree walks included -- into a
    dict lookup: measured 20-27 % (all nodes) and 49 % (half of them
    referenced) slower over a 9k-leaf traversal.  Set once here, on a probe
    made without ``__init__`` (so it takes no node id), before any real
    instance exists: the import hook runs this right after the module loads."""
    probe = object.__new__(cls)
    for name in names:
        setattr(probe, name, getattr(cls, name))


def apply_component_data(module) -> None:
    """``ComponentData`` gains the per-node session fields as class-level
    defaults, so nodes pay nothing until a session touches them."""
    cd = module.ComponentData
    if not hasattr(cd, "session_ref"):
        cd.session_ref = 0
        cd.session_below = None  # SWA: distance -> leaf references
        cd.session_leaf_of = None
        share_instance_keys(cd, ("session_ref", "session_below", "session_leaf_of"))


# ---- wiring helpers -------------------------------------------------------


def _on_ref_change(cache, node, ct) -> None:
    # Both lists are PartitionedLRUList once tracking is attached.  The host
    # list is empty without HiCache: skip the call (every reference flip of
    # an SWA/Mamba node lands here).
    cache.lru_lists[ct].move_to_partition(node)
    host = cache.host_lru_lists[ct]
    if host.cache:
        host.move_to_partition(node)


def _install_partitioned_lrus(cache) -> None:
    from sglang_session_cache.partitioned_lru import PartitionedLRUList

    tc = cache.tree_components
    cache.lru_lists = {ct: PartitionedLRUList(ct, tc) for ct in tc}
    cache.host_lru_lists = {
        ct: PartitionedLRUList(ct, tc, use_host_ptr=True) for ct in tc
    }


def attach_session_tracking(cache) -> None:
    from sglang_session_cache.session_tracker import UnifiedSessionRefTracker

    cache.session_ref_tracker = UnifiedSessionRefTracker(
        cache, on_ref_change=functools.partial(_on_ref_change, cache)
    )
    _install_partitioned_lrus(cache)
    from sglang_session_cache.patches.admission_eviction import (
        SHORTFALL_ATTR,
        shortfall_rule_applies,
    )

    setattr(cache, SHORTFALL_ATTR, shortfall_rule_applies(cache))
    from sglang_session_cache.session_eviction import (
        SessionAwareFullComponent,
        keep_leaf_heap,
        make_device_leaf_evictor,
    )

    # On this instance only: SGLang's callers (the components' eviction
    # walks) reach it as ``self.cache._evict_device_leaf``.
    evict_device_leaf = make_device_leaf_evictor(type(cache))
    if evict_device_leaf is not None:
        cache._evict_device_leaf = types.MethodType(evict_device_leaf, cache)
    keep_leaf_heap(cache)  # FULL's heap kept across evictions (lru only)

    if not isinstance(cache.components.get(0), SessionAwareFullComponent):
        # Finishing requests find their session leaf through this component.
        logger.warning(
            "Session radix cache: the FULL component was overridden (%s); session "
            "references will not be registered.",
            type(cache.components.get(0)).__name__,
        )
    logger.info(
        "Session radix cache enabled on the unified tree (components %s): "
        "referenced KV is evicted last, never pinned.",
        ", ".join(str(ct) for ct in cache.tree_components),
    )


def locate_node(cache, key):
    """The node an insert of ``key`` ended on, without touching LRU state
    (for benchmarks and tests; finishing requests capture it during the insert)."""
    key, _ = key.maybe_to_bigram_view(cache.is_eagle)
    key = key.page_aligned(cache.page_size)
    node = cache.root_node
    page_size = cache.page_size
    while len(key) > 0:
        child = node.children.get(key.child_key(page_size))
        if child is None:
            return None
        matched = child.key.match(key, page_size=page_size)
        if matched < len(child.key):
            return None
        key = key[matched:]
        node = child
    return node


# ---- method wrappers -------------------------------------------------------


def _wrap_init(orig):
    def __init__(self, params):
        enabled = bool(getattr(params, "enable_session_radix_cache", False))
        if enabled:
            from sglang_session_cache.session_eviction import (
                SESSION_COMPONENT_REGISTRY,
            )

            # An explicit override (e.g. MLX's Mamba component) still wins.
            override = {
                **SESSION_COMPONENT_REGISTRY,
                **(params.component_registry_override or {}),
            }
            params = dataclasses.replace(params, component_registry_override=override)
        orig(self, params)
        if enabled:
            attach_session_tracking(self)
            _configure_ttl_and_metrics(self, params)

    return __init__


def _wrap_reset_full(orig):
    def _reset_full(self):
        orig(self)
        tracker = self.session_ref_tracker
        if tracker is not None:
            _install_partitioned_lrus(self)
            tracker.reset()
            heap = self._session_leaf_heap
            if heap is not None:
                heap.clear()

    return _reset_full


def _wrap_cache_finished_req(orig):
    from sglang_session_cache.session_tracker import REQ_INFLIGHT_ATTR, REQ_STREAM_BUSY_ATTR

    def cache_finished_req(self, req, is_insert=True, *, kv_len_to_handle, **kwargs):
        tracker = self.session_ref_tracker
        if tracker is None or (
            # No session of any kind and never counted in flight: nothing to
            # register or finish (plain attribute reads, nothing that can raise).
            # A streaming request SGLang detached from its session
            # (req.session = None) is still counted: it finishes below.
            getattr(req, "session_id", None) is None
            and getattr(req, "session", None) is None
            and getattr(req, REQ_INFLIGHT_ATTR, None) is None
            and getattr(req, REQ_STREAM_BUSY_ATTR, None) is None
        ):
            return orig(self, req, is_insert, kv_len_to_handle=kv_len_to_handle, **kwargs)
        register = is_insert and guarded(tracker.should_register, req)
        if not register:
            out = orig(self, req, is_insert, kv_len_to_handle=kv_len_to_handle, **kwargs)
            guarded(tracker.request_finished, req)
            return out
        capture = []
        self._session_insert_capture = capture
        try:
            out = orig(self, req, is_insert, kv_len_to_handle=kv_len_to_handle, **kwargs)
        finally:
            self._session_insert_capture = None
        # The session-aware FULL component recorded where the insert ended;
        # registered only after the insert (and the whole finish) succeeded.
        if capture and capture[-1] is not None:
            guarded(tracker.register_checked, req, capture[-1])
        guarded(tracker.request_finished, req)
        return out

    return cache_finished_req


def guarded(fn, *args):
    """Run one of our session hooks on the scheduler path: an exception is
    logged (first one with its traceback) and never reaches SGLang's loop."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - nothing of ours may crash the scheduler
        if not _hook_failures:
            logger.exception("session radix cache hook %s failed; continuing", fn.__name__)
        else:
            logger.warning("session radix cache hook %s failed: %s", fn.__name__,
                           type(e).__name__)
        _hook_failures.append(fn.__name__)
        del _hook_failures[16:]
        return None


_hook_failures: list = []


def _wrap_split_node(orig):
    def _split_node(self, key, child, split_len):
        new_node = orig(self, key, child, split_len)
        tracker = self.session_ref_tracker
        if tracker is not None:
            tracker.on_split(new_node, child)
        return new_node

    return _split_node


def _wrap_remove_leaf(orig):
    def _remove_leaf_from_parent(self, node):
        tracker = self.session_ref_tracker
        if tracker is None:
            return orig(self, node)
        tracker.on_node_deleted(node)
        out = orig(self, node)
        heap = self._session_leaf_heap
        if heap is not None:
            heap.forget(node)
        return out

    return _remove_leaf_from_parent


def _wrap_evict_component(orig):
    from sglang.srt.mem_cache.unified_cache_components import ComponentType, EvictLayer

    # Plain ints: comparing a flag member with one stays in C (``Flag``'s
    # own ``&`` and ``in`` are Python-level).
    device, both = int(EvictLayer.DEVICE), int(EvictLayer.ALL)
    full_ct = ComponentType.FULL

    def _evict_component_and_detach_lru(self, node, comp, target=EvictLayer.DEVICE, tracker=None):
        refs = self.session_ref_tracker
        if refs is None:
            return orig(self, node, comp, target, tracker)
        cd = node.component_data[comp.component_type]
        if cd.session_ref:
            # Soft-protection breach: referenced data may be about to go
            # (counted below only if device data was actually freed).  A
            # session leaf's state that goes one layer at a time relocates
            # now; both layers at once mean the node is deleted next, which
            # relocates then.  (A session leaf always holds a reference of
            # its own, so only referenced nodes are checked.)
            if (target != both and cd.session_leaf_of is not None
                    and comp in refs.relocating_components):
                refs.on_component_evict(node, comp.component_type, target == device)
            freed = orig(self, node, comp, target, tracker)
            if freed[0]:
                # Inlined (this is the eviction path): [events, tokens].
                counts = refs.breaches[comp.component_type]
                counts[0] += 1
                counts[1] += freed[0]
            return freed
        if (refs.policy.scale.capacity and comp.component_type == full_ct
                and int(target) & device and cd.value is not None):
            # Unreferenced KV going while references hold other KV: a ghost
            # for the learned protection scale (protection_scale.py; only
            # with --session-radix-cache-max-protected-fraction auto).
            guarded(refs.on_unreferenced_evict, node)
        return orig(self, node, comp, target, tracker)

    return _evict_component_and_detach_lru


def _wrap_match_prefix(orig):
    def match_prefix(self, params):
        result = orig(self, params)
        tracker = self.session_ref_tracker
        if tracker is not None and tracker.policy.scale.capacity:
            req = getattr(params, "req", None)
            if req is not None:  # a scheduler match, not a lookup
                guarded(tracker.on_match, req, params.key, result)
        return result

    return match_prefix


def _wrap_check_lru(orig):
    def _check_lru_linked_list(self, lru, ct, label, errors):
        integrity = getattr(lru, "integrity_errors", None)
        if integrity is None:
            return orig(self, lru, ct, label, errors)
        errors.extend(integrity(label))

    return _check_lru_linked_list


def _wrap_evict(orig):
    def evict(self, params):
        tracker = self.session_ref_tracker
        if tracker is not None:
            # The protection bound holds whenever victims are chosen.
            tracker.enforce_protection_bound()
        return orig(self, params)

    return evict


def _configure_ttl_and_metrics(cache, params) -> None:
    """TTL (``--session-radix-cache-ttl``) and the protection options
    (``protection_policy.py``) from the process-wide ServerArgs;
    a Prometheus collector when the cache reports metrics."""
    from sglang_session_cache.protection_policy import published_options
    from sglang_session_cache.session_ttl import published_ttl

    cache.session_ref_tracker.configure_protection(*published_options())
    ttl = cache.session_ref_tracker.set_ttl(published_ttl())
    if ttl is not None:
        logger.info(
            "Session radix cache: sessions idle for %gs are released as if closed.",
            ttl,
        )
    if getattr(params, "enable_metrics", False):
        from sglang_session_cache.session_metrics import make_collector

        cache.session_metrics_collector = make_collector(cache)


# ---- new public methods -----------------------------------------------------


def open_radix_session(self, session_id: str, streaming: bool = False, timeout=None):
    """Open a session (``/open_session``); returns its generation, or None
    when session tracking is off or the session is streaming.  ``timeout``:
    this session's own idle TTL (seconds)."""
    tracker = self.session_ref_tracker
    if tracker is None:
        return None
    return tracker.open_radix_session(session_id, streaming=streaming, timeout=timeout)


def release_radix_session(self, session_id: str) -> int:
    """Close a session (``/close_session``): drop its references; the KV stays
    cached as ordinary LRU data.  Returns the number of leaf refs dropped."""
    tracker = self.session_ref_tracker
    if tracker is None:
        return 0
    return tracker.release_radix_session(session_id)


def ensure_session_generation(self, req_or_session_id):
    """The session's current generation, opening it implicitly if needed.
    Takes a session id (upstream's signature) or an arriving ``Req``, which is
    also stamped with it.  ``None`` when session tracking is off."""
    tracker = self.session_ref_tracker
    if tracker is None:
        return None
    return tracker.ensure_session_generation(req_or_session_id)


def _session_refs(self):
    """Upstream's name for the session tracker (``None`` when tracking is off)."""
    return self.session_ref_tracker


def validate_session_state(self) -> None:
    """Recompute all session counts from the leaf indices and check every
    partitioned LRU; raises ``SessionStateError`` on any mismatch."""
    from sglang_session_cache.component_refs import SessionStateError

    tracker = self.session_ref_tracker
    if tracker is None:
        return
    tracker.validate_session_state(self._collect_all_nodes())
    errors = []
    for label, lists in (("device", self.lru_lists), ("host", self.host_lru_lists)):
        for lru in lists.values():
            errors.extend(lru.integrity_errors(label))
    if errors:
        raise SessionStateError("; ".join(errors))


def session_metrics(self) -> dict:
    """Snapshot of the session metrics (``{"enabled": False}`` when session
    tracking is off); see ``sglang_session_cache.session_metrics``."""
    from sglang_session_cache.session_metrics import snapshot

    return snapshot(self)


def expire_idle_sessions(self) -> int:
    """Release the sessions due at the shared clock; returns how many."""
    tracker = self.session_ref_tracker
    if tracker is None:
        return 0
    return tracker.expire_idle_sessions()


def advance_session_clock(self, t: float) -> int:
    """Deliver a shared-clock value (seconds, decided once for all ranks and
    delivered in scheduler order) and expire what is due; returns how many."""
    tracker = self.session_ref_tracker
    if tracker is None:
        return 0
    return tracker.advance_clock(t)


def apply_session_ttl_metrics(module) -> None:
    cls = module.UnifiedRadixCache
    if "session_metrics_collector" not in cls.__dict__:
        cls.session_metrics_collector = None
        cls._session_ref_tokens_cache = None
    wrap_method(cls, "evict", _wrap_evict)
    add_method(cls, "session_metrics", session_metrics)
    add_method(cls, "expire_idle_sessions", expire_idle_sessions)
    add_method(cls, "advance_session_clock", advance_session_clock)


def apply_unified_cache(module) -> None:
    cls = module.UnifiedRadixCache
    if "session_ref_tracker" not in cls.__dict__:
        cls.session_ref_tracker = None
        cls._session_insert_capture = None
        cls._session_leaf_heap = None  # full_leaf_heap.FullLeafHeap (lru)
        # Read-only alias, so the two names can never disagree.
        cls.session_refs = property(_session_refs)
    if not hasattr(module.UnifiedTreeNode, "full_session_ref"):
        # FULL's session count mirrored on the node for the eviction heap,
        # and the partitioned LRU's recency stamp (partitioned_lru.py), read
        # through these defaults until a node first sets them.  Never through
        # ``node.__dict__``: that too gives the node a real dict (see
        # share_instance_keys).
        module.UnifiedTreeNode.full_session_ref = 0
        module.UnifiedTreeNode.lru_stamp = None
        share_instance_keys(module.UnifiedTreeNode, ("full_session_ref", "lru_stamp"))
    wrap_method(cls, "__init__", _wrap_init)
    wrap_method(cls, "_reset_full", _wrap_reset_full)
    wrap_method(cls, "cache_finished_req", _wrap_cache_finished_req)
    wrap_method(cls, "_split_node", _wrap_split_node)
    wrap_method(cls, "_remove_leaf_from_parent", _wrap_remove_leaf)
    wrap_method(cls, "_evict_component_and_detach_lru", _wrap_evict_component)
    wrap_method(cls, "_check_lru_linked_list", _wrap_check_lru)
    wrap_method(cls, "match_prefix", _wrap_match_prefix)
    for fn in (
        open_radix_session,
        release_radix_session,
        ensure_session_generation,
        validate_session_state,
    ):
        add_method(cls, fn.__name__, fn)
