"""SWA retain floor (issue 5): keep the sliding window under the last Mamba
checkpoint alive so hybrid SWA + Mamba models can reuse decoded tokens.

Four small patches, one per SGLang module (see ``retain_floor`` for the
arithmetic and why the seam is exact):

* ``common.free_swa_out_of_window_slots`` gains ``retain_floor=None``. ``None``
  (or the chunk-cache path) calls the original with the very same arguments;
  otherwise ``pre_len`` is lowered so the radix threshold becomes
  ``min(threshold, retain_floor)``.
* ``BasePrefixCache.swa_retain_floor(req)`` returns ``None``;
  ``UnifiedRadixCache.swa_retain_floor(req)`` returns ``checkpoint - window``
  when the tree has both SWA and Mamba, where ``checkpoint`` is the deeper of
  the request's ``mamba_last_track_seqlen`` and (extra-buffer Mamba only) the
  tree-side checkpoint: ``req.cache_protected_len`` when ``req.last_node``
  holds a Mamba state. The latter covers the prefill region, where
  ``cache_unfinished_req`` has just cleared the request field.
* ``ScheduleBatch._evict_swa`` (decode) and
  ``SWAComponent.free_out_of_window_slots`` (chunked prefill) pass the floor.
"""

from __future__ import annotations

import inspect

from sglang_session_cache.patches._wrap import add_method, wrap_method
from sglang_session_cache.retain_floor import (
    clamp_pre_len,
    retain_floor_from_checkpoint,
    retain_floor_from_checkpoints,
)

_COMMON = "sglang.srt.mem_cache.common"


def _common_module():
    # Already imported by the module being patched; looked up once at patch
    # time, the function itself at call time.
    import importlib

    return importlib.import_module(_COMMON)


def _tree_retain_floor(tree_cache, req):
    """The cache's floor for ``req``; ``None`` for caches without the method."""
    fn = getattr(tree_cache, "swa_retain_floor", None)
    return fn(req) if fn is not None else None


# ---- sglang.srt.mem_cache.common ---------------------------------------------


def _wrap_free_swa_out_of_window_slots(orig):
    def free_swa_out_of_window_slots(
        req,
        pre_len,
        *,
        sliding_window_size,
        page_size,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        is_chunk_cache=False,
        retain_floor=None,
    ):
        pre_len = clamp_pre_len(
            pre_len,
            retain_floor,
            sliding_window_size=sliding_window_size,
            page_size=page_size,
            is_chunk_cache=is_chunk_cache,
        )
        return orig(
            req,
            pre_len,
            sliding_window_size=sliding_window_size,
            page_size=page_size,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            is_chunk_cache=is_chunk_cache,
        )

    # update_wrapper sets __wrapped__, which inspect.signature would follow
    # back to the original; pin the extended signature instead.
    free_swa_out_of_window_slots.__signature__ = inspect.signature(
        free_swa_out_of_window_slots
    )
    return free_swa_out_of_window_slots


def apply_common(module) -> None:
    # Wrapped on the module before schedule_batch / swa_component run their
    # from-imports, so both bind this version.
    wrap_method(module, "free_swa_out_of_window_slots", _wrap_free_swa_out_of_window_slots)


# ---- sglang.srt.mem_cache.base_prefix_cache ----------------------------------


def _base_swa_retain_floor(self, req):
    """Lowest position whose SWA KV decode-side eviction must keep for ``req``
    (``None``: no floor, evict relative to the tail as before)."""
    return None


def apply_base_prefix_cache(module) -> None:
    add_method(module.BasePrefixCache, "swa_retain_floor", _base_swa_retain_floor)


# ---- sglang.srt.mem_cache.unified_radix_cache --------------------------------


def _tree_checkpoint(cache, req, mamba_type):
    """Depth of the request's deepest cached prefix that ends in a Mamba state,
    or ``None``.

    ``req.last_node`` / ``req.cache_protected_len`` come from the admission
    match or, after ``cache_unfinished_req``, from its re-match; both only stop
    at a node whose Mamba value is present (``MambaComponent``'s validator) and
    ``cache_protected_len`` is that node's depth (``len`` of the matched device
    indices). The request's lock keeps that value in place. Only with the
    extra buffer: there decode records later checkpoints that take over; in
    no-buffer mode the finish insert ends at the live tail and no floor is
    needed (see ``retain_floor``)."""
    mamba = cache.components.get(mamba_type)
    if mamba is None or not mamba.enable_mamba_extra_buffer:
        return None
    node = getattr(req, "last_node", None)
    if node is None or node is cache.root_node:
        return None
    data = getattr(node, "component_data", None)
    if data is None or data[mamba_type].value is None:
        return None
    depth = req.cache_protected_len
    return depth if depth > 0 else None


def _request_only_swa_retain_floor(self, req):
    """The retain floor from the request's own checkpoint only
    (``mamba_last_track_seqlen - sliding_window_size``): the behaviour before the
    tree-side checkpoint was added. Not installed on the class; the replay uses
    it as its "old floor" setting."""
    if self.disable or not (self.supports_swa() and self.supports_mamba()):
        return None
    return retain_floor_from_checkpoint(
        getattr(req, "mamba_last_track_seqlen", None), self.sliding_window_size
    )


def _make_unified_swa_retain_floor(mamba_type):
    def swa_retain_floor(self, req):
        """``max(request checkpoint, tree checkpoint) - sliding_window_size``
        (at least 0) when the tree holds both SWA and Mamba: a match can only
        end at a Mamba checkpoint, and the SWA component accepts it only with a
        full window of SWA KV below it. The request checkpoint is
        ``mamba_last_track_seqlen``; the tree checkpoint is
        ``cache_protected_len`` when ``last_node`` holds a Mamba state (extra
        buffer only). ``None`` without either, for other component sets, or
        when the cache is disabled (nothing will be inserted), and without
        ``--enable-session-radix-cache``: with every flag of ours off, decode
        frees SWA slots exactly as stock 0.5.16 does."""
        if self.disable or getattr(self, "session_ref_tracker", None) is None:
            return None
        if not (self.supports_swa() and self.supports_mamba()):
            return None
        return retain_floor_from_checkpoints(
            getattr(req, "mamba_last_track_seqlen", None),
            _tree_checkpoint(self, req, mamba_type),
            self.sliding_window_size,
        )

    return swa_retain_floor


def apply_unified_radix_cache(module) -> None:
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    add_method(
        module.UnifiedRadixCache,
        "swa_retain_floor",
        _make_unified_swa_retain_floor(ComponentType.MAMBA),
    )


# ---- sglang.srt.mem_cache.unified_cache_components.swa_component -------------


def _wrap_component_free_out_of_window_slots(orig, common):
    # Same body as 0.5.16, plus the cache's retain floor.
    def free_out_of_window_slots(self, req, pre_len, insert_params):
        if self.sliding_window_size is not None:
            common.free_swa_out_of_window_slots(
                req,
                pre_len,
                sliding_window_size=self.sliding_window_size,
                page_size=self.cache.page_size,
                req_to_token_pool=self.cache.req_to_token_pool,
                token_to_kv_pool_allocator=self.cache.token_to_kv_pool_allocator,
                retain_floor=_tree_retain_floor(self.cache, req),
            )
        insert_params.swa_evicted_seqlen = req.kv.swa_evicted_seqlen

    return free_out_of_window_slots


def apply_swa_component(module) -> None:
    common = _common_module()
    wrap_method(
        module.SWAComponent,
        "free_out_of_window_slots",
        lambda orig: _wrap_component_free_out_of_window_slots(orig, common),
    )


# ---- sglang.srt.managers.schedule_batch --------------------------------------


def _wrap_evict_swa(orig, common):
    # Same body as 0.5.16, plus the tree cache's retain floor.
    def _evict_swa(self, req, pre_len):
        assert self.tree_cache.supports_swa(), "prefix cache must support swa"
        common.free_swa_out_of_window_slots(
            req,
            pre_len,
            sliding_window_size=self.tree_cache.sliding_window_size,
            page_size=self.tree_cache.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            is_chunk_cache=self.tree_cache.is_chunk_cache(),
            retain_floor=_tree_retain_floor(self.tree_cache, req),
        )

    return _evict_swa


def apply_schedule_batch(module) -> None:
    common = _common_module()
    wrap_method(
        module.ScheduleBatch, "_evict_swa", lambda orig: _wrap_evict_swa(orig, common)
    )
