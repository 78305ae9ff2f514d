"""CPU harness around a real SGLang 0.5.16 ``UnifiedRadixCache`` (used by the
tests and the benchmarks).

Every object the cache touches is the real SGLang class: ``ReqToTokenPool`` /
``HybridReqToTokenPool`` (with a real, tiny ``MambaPool``), ``MHATokenToKVPool``
/ ``SWAKVPool``, ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` /
``SWATokenToKVPoolAllocator`` and ``sglang.srt.managers.schedule_batch.Req``.
The harness only plays the part of the scheduler: it calls the same cache and
pool entry points, in the same order, that ``Scheduler`` / ``PrefillAdder`` /
``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` /
``release_kv_cache`` do, without a model forward.

Shapes::

    make_full_cache(...)        FULL                  (any page_size)
    make_swa_cache(...)         FULL + SWA            (any page_size, 4 by default)
    make_full_mamba_cache(...)  FULL + MAMBA          (page_size 1)
    make_swa_mamba_cache(...)   FULL + SWA + MAMBA    (page_size 1)

Request life cycle (what each helper mirrors):

``prefill(req)``
    ``Req.init_next_round_input(tree_cache)`` (match_prefix with the scheduler's
    ``RadixKey(limit=len-1)`` and ``cow_mamba=supports_mamba()``), then the
    ``PrefillAdder`` lock (``inc_lock_ref`` + ``swa_uuid_for_lock``), then
    ``alloc_for_extend`` (``alloc_req_slots``, ``alloc_token_slots`` or the paged
    equivalent, req_to_token write, ``req.kv = ReqKvInfo``), the per-request part
    of ``prepare_for_extend`` (``kv_committed_len``, ``cached_tokens``, deferred
    Mamba copy-on-write / clear) and finally what ``process_batch_result`` does
    after the prefill forward: append the sampled token and, unless the request
    finishes right away, ``maybe_cache_unfinished_req``. With ``chunk_size``,
    middle chunks go through ``cache_unfinished_req(chunked=True)`` +
    ``init_next_round_input()`` + ``add_chunked_req`` like the scheduler's
    chunked prefill.
``decode(req, n)``
    ``n`` x (``maybe_evict_swa`` + ``alloc_for_decode`` + ``kv_committed_len += 1``
    + append the sampled token).
``finish(req)``
    ``sglang.srt.mem_cache.common.release_kv_cache`` -- the scheduler's finish
    path: ``cache_finished_req(req, kv_len_to_handle=effective_kv_committed_len)``,
    over-allocation release, req slot free.

Deliberate deviations from the GPU scheduler (documented where they happen):

* Paged allocation (``page_size > 1``): ``PagedTokenToKVPoolAllocator.alloc_extend``
  / ``alloc_decode`` are Triton kernels, which cannot run on CPU tensors. The
  harness reproduces their index arithmetic (fill the tail of the last partial
  page, then take whole new pages) on top of the allocators' public page-granular
  ``alloc()`` and ``set_full_to_swa_mapping()``. ``page_size == 1`` uses SGLang's
  own ``alloc_token_slots``.
* ``get_server_args()`` is served by a dummy-boundary ``ServerArgs`` published
  through SGLang's own test hook ``get_context().override_server_args()`` (no
  model is loaded). ``MambaComponent.finalize_match_result`` reads the
  ``mamba_cache_chunk_size`` property, which would resolve the HF model config
  of ``model_path``; the harness pre-seeds the property's own cache attribute
  ``_mamba_cache_chunk_size`` instead (64 = FLA chunk size, SGLang's default).
* SWA out-of-window eviction runs every ``swa_eviction_interval`` decode steps
  (default 1 here; the server default ``SGLANG_SWA_EVICTION_INTERVAL`` is 128
  *batches*), so short tests actually exercise SWA tombstones.
* Mamba shapes use ``page_size == 1`` without ``--enable-mamba-extra-buffer``:
  ``MambaComponent`` rejects ``page_size > 1`` unless the extra buffer is on,
  and the extra-buffer mode needs the per-forward ping-pong state tracking
  (``mamba_last_track_seqlen`` etc.) that only a model forward produces.
  Note that ``alloc_req_slots`` wants 3 free Mamba slots per admission
  (``MAMBA_STATE_PER_REQ_PREFIX_CACHE``) and evicts cached states to get them.

The cache is built directly with ``UnifiedRadixCache(CacheInitParams(...))``,
as ``registry._create_unified_radix_cache`` does, so
``SGLANG_ENABLE_UNIFIED_RADIX_TREE`` is not needed.

``CacheHarness.check()`` runs ``UnifiedRadixCache.sanity_check()`` and a slot
conservation check for every pool: free slots (allocator) + slots referenced by
the tree + slots owned by in-flight requests must partition the pool exactly
(no leak, no double ownership, no double free).
"""

from __future__ import annotations

import contextlib
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import (
    evict_from_tree_cache,
    free_swa_out_of_window_slots,
    maybe_cache_unfinished_req,
    release_kv_cache,
)
from sglang.srt.mem_cache.memory_pool import (
    HybridReqToTokenPool,
    MHATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache_components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams

__all__ = [
    "CacheHarness",
    "make_full_cache",
    "make_swa_cache",
    "make_full_mamba_cache",
    "make_swa_mamba_cache",
    "publish_server_args",
    "release_server_args",
]

DEVICE = "cpu"
KV_DTYPE = torch.bfloat16
# SGLang's FLA_CHUNK_SIZE; ServerArgs.mamba_cache_chunk_size = max(it, page_size).
DEFAULT_MAMBA_CACHE_CHUNK_SIZE = 64
# Output tokens the fake "model" samples come from this range, far above the
# small prompt ids tests use, so they never collide with prompt tokens.
_OUTPUT_TOKEN_BASE = 1_000_000


# --------------------------------------------------------------------------
# Global ServerArgs (get_server_args())
# --------------------------------------------------------------------------

_server_args_override = None
#: Extra ``ServerArgs`` attributes every published ``ServerArgs`` carries
#: (e.g. the session protection options); tests may replace it.
SESSION_SERVER_ARGS: dict = {}


def publish_server_args(
    page_size: int = 1,
    mamba_cache_chunk_size: int = DEFAULT_MAMBA_CACHE_CHUNK_SIZE,
):
    """Publish a real (dummy-boundary) ``ServerArgs`` as the process-wide one.

    Uses ``RuntimeContext.override_server_args``, SGLang's test hook: it builds
    ``ServerArgs(model_path="dummy")`` without materializing a model config.
    Re-publishing replaces the one this module installed earlier; whatever was
    published before the first call comes back on ``release_server_args()``.
    """
    global _server_args_override
    if _server_args_override is not None:
        _server_args_override.restore()
        _server_args_override = None
    override = get_context().override_server_args(page_size=page_size)
    server_args = override.install()
    # ``mamba_cache_chunk_size`` is a lazily cached property that would load the
    # HF config of ``model_path``; seed its cache with SGLang's default instead.
    server_args._mamba_cache_chunk_size = max(mamba_cache_chunk_size, page_size)
    for name, value in SESSION_SERVER_ARGS.items():
        object.__setattr__(server_args, name, value)  # past the mutation guard
    _server_args_override = override
    return server_args


@contextlib.contextmanager
def session_server_args(options: dict):
    """``SESSION_SERVER_ARGS`` set to ``options`` for the ``with`` block
    (every ``ServerArgs`` published meanwhile carries them), then restored,
    so a run leaves the harness as it found it."""
    global SESSION_SERVER_ARGS
    saved = SESSION_SERVER_ARGS
    SESSION_SERVER_ARGS = options
    try:
        yield
    finally:
        SESSION_SERVER_ARGS = saved


def release_server_args() -> None:
    """Restore whatever ``ServerArgs`` was published before this module's."""
    global _server_args_override
    if _server_args_override is not None:
        _server_args_override.restore()
        _server_args_override = None


# --------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(repr=False)
class CacheHarness:
    """A real ``UnifiedRadixCache`` plus the pools it manages, and the
    scheduler-side request life cycle (see the module docstring).

    ``allocator`` is the cache's ``token_to_kv_pool_allocator``; for SWA shapes
    ``full_allocator`` / ``swa_allocator`` are its two sub-allocators, and
    ``mamba_allocator`` is the ``HybridReqToTokenPool``'s slot allocator.
    ``live_reqs`` holds the requests between ``prefill`` and ``finish``.
    """

    cache: UnifiedRadixCache
    req_to_token_pool: ReqToTokenPool
    allocator: Any
    kv_pool: Any
    page_size: int
    sliding_window_size: Optional[int] = None
    # Decode steps between SWA out-of-window evictions (ScheduleBatch.maybe_evict_swa).
    swa_eviction_interval: int = 1
    # Requests between prefill and finish, by rid.
    live_reqs: dict = field(default_factory=dict)
    _planned_outputs: dict = field(default_factory=dict)
    _rid_counter: Any = field(default_factory=itertools.count)
    _token_counter: Any = field(
        default_factory=lambda: itertools.count(_OUTPUT_TOKEN_BASE)
    )
    _forward_iter: int = 0

    def __repr__(self) -> str:
        comps = "+".join(str(ct) for ct in self.cache.tree_components)
        return (
            f"CacheHarness({comps}, page_size={self.page_size}, "
            f"sliding_window_size={self.sliding_window_size}, "
            f"live={list(self.live_reqs)}, available={self.available()})"
        )

    # ---- shape queries ----

    @property
    def has_swa(self) -> bool:
        return self.cache.supports_swa()

    @property
    def has_mamba(self) -> bool:
        return self.cache.supports_mamba()

    @property
    def full_allocator(self):
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            return self.allocator.full_attn_allocator
        return self.allocator

    @property
    def swa_allocator(self):
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            return self.allocator.swa_attn_allocator
        return None

    @property
    def mamba_allocator(self):
        return getattr(self.req_to_token_pool, "mamba_allocator", None)

    # ---- requests ----

    def new_req(
        self,
        token_ids: Sequence[int],
        session_id: Optional[str] = None,
        rid: Optional[str] = None,
        output_ids: Iterable[int] = (),
        *,
        max_new_tokens: int = 1 << 20,
        extra_key: Optional[str] = None,
        priority: Optional[int] = None,
    ) -> Req:
        """A real ``Req``. ``output_ids`` are the tokens the fake model will
        sample, in order (one at prefill, one per decode step); once they run
        out, fresh unique ids are generated."""
        if rid is None:
            rid = f"req-{next(self._rid_counter)}"
        req = Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=array("q", [int(t) for t in token_ids]),
            sampling_params=SamplingParams(
                max_new_tokens=max_new_tokens, ignore_eos=True
            ),
            extra_key=extra_key,
            priority=priority,
            session_id=session_id,
        )
        self._planned_outputs[rid] = list(output_ids)
        return req

    def _sample(self, req: Req) -> int:
        planned = self._planned_outputs.get(req.rid)
        if planned:
            return int(planned.pop(0))
        return next(self._token_counter)

    def prefill(
        self, req: Req, finishing: bool = False, chunk_size: Optional[int] = None
    ) -> int:
        """Schedule ``req`` for prefill and run the post-forward bookkeeping.

        ``finishing=True`` means the request finishes with the token sampled at
        prefill (``finish`` follows directly, as for ``max_new_tokens=1``), so
        ``cache_unfinished_req`` is skipped like in ``process_batch_result``.
        ``chunk_size`` (a multiple of page_size) runs chunked prefill: every
        middle chunk is stashed with ``cache_unfinished_req(chunked=True)``
        before the next chunk is scheduled, as ``Scheduler`` does.
        Returns the matched prefix length (also ``req.matched_prefix_len``).
        """
        assert req.req_pool_idx is None and req.kv is None, "request already running"
        assert req.rid not in self.live_reqs, f"rid {req.rid!r} is already running"
        if chunk_size is not None:
            assert chunk_size > 0 and chunk_size % self.page_size == 0, chunk_size
        cache = self.cache

        # Scheduler.get_new_batch_prefill -> Req.init_next_round_input: match with
        # RadixKey(limit=len-1) and cow_mamba=tree_cache.supports_mamba().
        req.init_next_round_input(cache)
        prefix_len = len(req.prefix_indices)
        req.matched_prefix_len = prefix_len

        # PrefillAdder.add_one_req + _req_inc_lock_ref.
        req.set_extend_range(prefix_len, self._chunk_end(req, prefix_len, chunk_size))
        lock_result = cache.inc_lock_ref(req.last_node)
        if self.has_swa:
            req.swa_uuid_for_lock = lock_result.swa_uuid_for_lock
        if req.extend_range.end < len(req.full_untruncated_fill_ids):
            req.inflight_middle_chunks += 1
        try:
            self._prepare_for_extend(req)
        except Exception:
            self._abort_admission(req, lock_result)
            raise
        self.live_reqs[req.rid] = req

        while req.inflight_middle_chunks > 0:
            # Middle chunk forward done (process_batch_result_prefill) ...
            req.inflight_middle_chunks -= 1
            # ... next round: stash_chunked_request, then add_chunked_req.
            maybe_cache_unfinished_req(req, cache, chunked=True)
            req.init_next_round_input()
            start = len(req.prefix_indices)
            req.set_extend_range(start, self._chunk_end(req, start, chunk_size))
            if req.extend_range.end < len(req.full_untruncated_fill_ids):
                req.inflight_middle_chunks += 1
            try:
                self._prepare_for_extend(req)
            except Exception:
                # What an abort of the in-flight chunked request does.
                req.inflight_middle_chunks = 0
                release_kv_cache(req, cache, is_insert=False)
                del self.live_reqs[req.rid]
                raise

        # Last chunk forward + process_batch_result_prefill.
        req.output_ids.append(self._sample(req))
        if not finishing:
            maybe_cache_unfinished_req(req, cache)
        return prefix_len

    def _chunk_end(self, req: Req, start: int, chunk_size: Optional[int]) -> int:
        total = len(req.full_untruncated_fill_ids)
        if chunk_size is None or total - start <= chunk_size:
            return total
        return (start + chunk_size) // self.page_size * self.page_size

    def _prepare_for_extend(self, req: Req) -> None:
        """ScheduleBatch.prepare_for_extend for one request (alloc_for_extend
        plus the per-request bookkeeping)."""
        prefix_len = len(req.prefix_indices)
        seq_len = req.extend_range.end
        assert req.extend_range.start == prefix_len
        self._alloc_for_extend(req, prefix_len, seq_len)
        req.extend_batch_idx += 1
        req.kv_committed_len = seq_len
        if not req.retracted_stain:
            req.cached_tokens += prefix_len - req.already_computed
            req.already_computed = seq_len
        req.is_retracted = False
        self._run_deferred_mamba_ops(req)

    def decode(self, req: Req, n: int = 1) -> None:
        """``n`` decode steps (ScheduleBatch.prepare_for_decode + forward)."""
        assert req.rid in self.live_reqs, "decode() needs a prefilled request"
        for _ in range(n):
            self._maybe_evict_swa(req)
            pos = req.kv_committed_len
            if self.page_size == 1:
                loc = alloc_token_slots(self.cache, 1)
            else:
                # alloc_paged_token_slots_decode over-estimates one page per request.
                row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
                last_loc = int(row[pos - 1])
                loc = self._alloc_paged(
                    pos, pos + 1, last_loc, evict_tokens=self.page_size, what="Decode"
                )
            self.req_to_token_pool.write(
                (req.req_pool_idx, slice(pos, pos + 1)), loc.to(torch.int32)
            )
            req.kv.kv_allocated_len += 1
            req.decode_batch_idx += 1
            req.kv_committed_len += 1
            self._forward_iter += 1
            req.output_ids.append(self._sample(req))

    def finish(self, req: Req) -> None:
        """The scheduler's finish path: ``release_kv_cache`` (which calls
        ``cache_finished_req(req, kv_len_to_handle=effective_kv_committed_len)``
        and frees the req slot; Mamba slots follow the cache's own cleanup)."""
        assert req.rid in self.live_reqs, "finish() needs a prefilled request"
        release_kv_cache(req, self.cache)
        del self.live_reqs[req.rid]
        self._planned_outputs.pop(req.rid, None)

    def run_request(
        self,
        token_ids: Sequence[int],
        session_id: Optional[str] = None,
        n_decode: int = 0,
        *,
        output_ids: Iterable[int] = (),
        rid: Optional[str] = None,
        chunk_size: Optional[int] = None,
    ) -> Req:
        """prefill + ``n_decode`` decode steps + finish. The returned request
        carries ``matched_prefix_len`` (tokens reused from the cache)."""
        req = self.new_req(
            token_ids, session_id=session_id, rid=rid, output_ids=output_ids
        )
        self.prefill(req, finishing=n_decode == 0, chunk_size=chunk_size)
        if n_decode:
            self.decode(req, n_decode)
        self.finish(req)
        return req

    def match_len(
        self, token_ids: Sequence[int], extra_key: Optional[str] = None
    ) -> int:
        """Length a lookup of ``token_ids`` matches on device, without admitting
        a request (no lock, no Mamba copy-on-write). Like any real match it may
        split nodes and refreshes LRU recency along the matched path."""
        result = self.cache.match_prefix(
            MatchPrefixParams(
                key=RadixKey(array("q", [int(t) for t in token_ids]), extra_key)
            )
        )
        return len(result.device_indices)

    def evict(
        self, num_tokens: int = 0, swa_num_tokens: int = 0, mamba_num: int = 0
    ) -> EvictResult:
        return self.cache.evict(
            EvictParams(
                num_tokens=num_tokens,
                swa_num_tokens=swa_num_tokens,
                mamba_num=mamba_num,
            )
        )

    def evict_all(self) -> EvictResult:
        """Evict everything evictable from every pool."""
        return self.evict(
            num_tokens=self.full_allocator.size,
            swa_num_tokens=self.swa_allocator.size if self.has_swa else 0,
            mamba_num=self.mamba_allocator.size if self.has_mamba else 0,
        )

    # ---- inspection ----

    def available(self) -> dict:
        """Free and evictable sizes per pool."""
        cache = self.cache
        out = {
            "full": self.full_allocator.available_size(),
            "full_evictable": cache.full_evictable_size(),
            "full_protected": cache.full_protected_size(),
            "req_slots": self.req_to_token_pool.available_size(),
        }
        if self.has_swa:
            out["swa"] = self.swa_allocator.available_size()
            out["swa_evictable"] = cache.swa_evictable_size()
            out["swa_protected"] = cache.swa_protected_size()
        if self.mamba_allocator is not None:
            out["mamba"] = self.mamba_allocator.available_size()
            out["mamba_evictable"] = cache.mamba_evictable_size()
            out["mamba_protected"] = cache.mamba_protected_size()
        return out

    def tree_nodes(self) -> list:
        return self.cache._collect_all_nodes()

    def check(self) -> None:
        """``sanity_check()`` + exact slot conservation for every pool."""
        self.cache.sanity_check()
        if self.cache.session.any_holding_kv():
            # Streaming-session slots own KV outside both the tree and the
            # request table; the partition below cannot account for them.
            return
        errors: list[str] = []
        if not self.live_reqs:
            self._check_idle_locks(errors)
        self._check_full(errors)
        if self.has_swa:
            self._check_swa(errors)
        if self.mamba_allocator is not None:
            self._check_mamba(errors)
        self._check_req_slots(errors)
        if errors:
            raise AssertionError(
                "slot conservation failed:\n  "
                + "\n  ".join(errors)
                + "\n"
                + self.cache.available_and_evictable_str()
            )

    # ---- allocation internals ----

    def _alloc_for_extend(
        self, req: Req, prefix_len: int, seq_len: int
    ) -> torch.Tensor:
        """sglang.srt.mem_cache.allocation.alloc_for_extend for one request."""
        # maybe_evict_swa() is a no-op for an extend batch on a radix cache.
        alloc_req_slots(self.req_to_token_pool, [req], self.cache)
        extend_len = seq_len - prefix_len
        if self.page_size == 1:
            out_cache_loc = alloc_token_slots(self.cache, extend_len)
        else:
            # alloc_for_extend takes last_loc from the prefix indices, and
            # alloc_paged_token_slots_extend over-estimates one page per request.
            last_loc = int(req.prefix_indices[-1]) if prefix_len > 0 else -1
            out_cache_loc = self._alloc_paged(
                prefix_len,
                seq_len,
                last_loc,
                evict_tokens=extend_len + self.page_size,
                what="Prefill",
            )
        # write_cache_indices (non-Triton branch).
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(0, prefix_len)), req.prefix_indices
        )
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(prefix_len, seq_len)), out_cache_loc
        )
        if req.kv is None:
            req.kv = ReqKvInfo(kv_allocated_len=seq_len, swa_evicted_seqlen=0)
        else:
            req.kv.kv_allocated_len = seq_len
        return out_cache_loc

    def _alloc_paged(
        self,
        prefix_len: int,
        seq_len: int,
        last_loc: int,
        *,
        evict_tokens: int,
        what: str,
    ) -> torch.Tensor:
        """CPU stand-in for the Triton ``alloc_extend`` / ``alloc_decode``
        kernels for one request: fill the rest of the page holding ``last_loc``
        (the KV slot of position ``prefix_len - 1``), then take whole new pages
        from the real allocator(s)."""
        ps = self.page_size
        evict_from_tree_cache(self.cache, evict_tokens)

        part1 = min(seq_len, _cdiv(prefix_len, ps) * ps) - prefix_len
        num_new_pages = _cdiv(seq_len, ps) - _cdiv(prefix_len, ps)
        rest = seq_len - prefix_len - part1

        swa = isinstance(self.allocator, SWATokenToKVPoolAllocator)
        if swa:
            ok = self.allocator.new_pages_available(num_new_pages, num_new_pages)
        else:
            ok = num_new_pages * ps <= self.allocator.available_size()
        if not ok:
            raise RuntimeError(
                f"{what} out of memory. "
                f"Try to allocate {seq_len - prefix_len} tokens.\n"
                f"{self.cache.available_and_evictable_str()}"
            )

        arange = torch.arange(part1, dtype=torch.int64)
        full_parts = [last_loc + 1 + arange]
        swa_parts = []
        if swa:
            swa_last_loc = -1
            if last_loc >= 0:
                translate = self.allocator.translate_loc_from_full_to_swa
                swa_last_loc = int(translate(torch.tensor([last_loc]))[0])
            swa_parts.append(swa_last_loc + 1 + arange)
        if num_new_pages > 0:
            if swa:
                full_new = self.allocator.full_attn_allocator.alloc(num_new_pages * ps)
                swa_new = self.allocator.swa_attn_allocator.alloc(num_new_pages * ps)
                assert full_new is not None and swa_new is not None
                swa_parts.append(swa_new[:rest])
            else:
                full_new = self.allocator.alloc(num_new_pages * ps)
                assert full_new is not None
            full_parts.append(full_new[:rest])
        out = torch.cat(full_parts).to(torch.int64)
        if swa:
            self.allocator.set_full_to_swa_mapping(out, torch.cat(swa_parts))
        return out

    def _abort_admission(self, req: Req, lock_result) -> None:
        """Undo a half-done admission when allocation fails."""
        self.cache.dec_lock_ref(req.last_node, lock_result.to_dec_params())
        req.inflight_middle_chunks = 0
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req)
        if self.mamba_allocator is not None and req.mamba_pool_idx is not None:
            self.mamba_allocator.free(req.mamba_pool_idx.view(-1))
            req.mamba_pool_idx = None
        req.kv = None

    def _run_deferred_mamba_ops(self, req: Req) -> None:
        """The forward-stream half of _collect_deferred_mamba_cow_and_clear:
        copy the matched radix state into the request slot, or zero a fresh one."""
        if req.mamba_pool_idx is None:
            return
        pool = self.req_to_token_pool
        dst = req.mamba_pool_idx.view(1)
        if req.mamba_cow_src_index is not None:
            src = req.mamba_cow_src_index.view(-1)
            pool.mamba_pool.copy_from(
                pool.translate_mamba_indices(src), pool.translate_mamba_indices(dst)
            )
            req.mamba_cow_src_index = None
            req.mamba_needs_clear = False
        elif req.mamba_needs_clear:
            pool.mamba_pool.clear_slots(pool.translate_mamba_indices(dst))
            req.mamba_needs_clear = False

    def _maybe_evict_swa(self, req: Req) -> None:
        """ScheduleBatch.maybe_evict_swa for a decode batch."""
        if not self.has_swa:
            return
        interval = max(1, self.swa_eviction_interval)
        if self._forward_iter % interval == 0 and req.decode_batch_idx >= 1:
            free_swa_out_of_window_slots(
                req,
                req.seqlen - 1,
                sliding_window_size=self.cache.sliding_window_size,
                page_size=self.cache.page_size,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                is_chunk_cache=False,
            )
        if (
            envs.SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW.get()
            and not req.swa_prefix_lock_released
            and req.swa_uuid_for_lock is not None
            and req.last_node is not None
            and req.decode_batch_idx >= self.cache.sliding_window_size
        ):
            self.cache.dec_swa_lock_only(req.last_node, req.swa_uuid_for_lock)
            req.swa_prefix_lock_released = True

    # ---- conservation internals ----

    def _req_owned_full_slots(self, req: Req) -> torch.Tensor:
        """KV slots a running request owns: everything past the tree-protected
        prefix (slots below cache_protected_len belong to the tree)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return row[req.cache_protected_len : req.kv.kv_allocated_len].to(torch.int64)

    def _check_partition(
        self,
        errors: list,
        name: str,
        universe: set,
        owners: dict,
    ) -> None:
        """Every id in ``universe`` is owned exactly once across ``owners``."""
        seen: dict = {}
        for owner, ids in owners.items():
            for i in ids:
                if i in seen:
                    errors.append(
                        f"{name}: slot {i} owned by both {seen[i]} and {owner}"
                    )
                    if len(errors) > 20:
                        return
                else:
                    seen[i] = owner
        stray = set(seen) - universe
        if stray:
            errors.append(f"{name}: ids outside the pool: {sorted(stray)[:10]}")
        leaked = universe - set(seen)
        if leaked:
            errors.append(f"{name}: {len(leaked)} leaked slots: {sorted(leaked)[:10]}")

    @staticmethod
    def _ids(t: Optional[torch.Tensor]) -> list:
        if t is None:
            return []
        return t.reshape(-1).tolist()

    def _pages(self, token_ids: list) -> list:
        ps = self.page_size
        if ps == 1:
            return list(token_ids)
        return sorted({int(i) // ps for i in token_ids})

    def _check_idle_locks(self, errors: list) -> None:
        """No request is running, so no node may stay locked (root aside)."""
        for ct in self.cache.tree_components:
            protected = self.cache.component_protected_size_[ct]
            if protected:
                errors.append(f"idle: {ct} protected size is {protected}, expected 0")
        for node in self.tree_nodes():
            if node is self.cache.root_node:
                continue
            for ct in self.cache.tree_components:
                cd = node.component_data[ct]
                if cd.lock_ref or cd.host_lock_ref:
                    errors.append(
                        f"idle: node {node.id} {ct} lock_ref={cd.lock_ref} "
                        f"host_lock_ref={cd.host_lock_ref}"
                    )

    def _check_full(self, errors: list) -> None:
        alloc = self.full_allocator
        ps = self.page_size
        if ps == 1:
            universe = set(range(1, alloc.size + 1))
        else:
            universe = set(range(1, alloc.num_pages + 1))
        free = self._ids(alloc.free_pages) + self._ids(alloc.release_pages)
        tree: list = []
        for node in self.tree_nodes():
            if node is self.cache.root_node:
                continue
            value = node.component_data[ComponentType.FULL].value
            if value is not None:
                ids = self._ids(value)
                if ps > 1 and len(ids) % ps:
                    errors.append(
                        f"full: node {node.id} value not page aligned ({len(ids)})"
                    )
                tree += self._pages(ids)
        owners = {"allocator": free, "tree": tree}
        for rid, req in self.live_reqs.items():
            owned = self._ids(self._req_owned_full_slots(req))
            owners[f"req {rid}"] = self._pages(owned)
        self._check_partition(errors, "full", universe, owners)

    def _check_swa(self, errors: list) -> None:
        alloc = self.swa_allocator
        ps = self.page_size
        if ps == 1:
            universe = set(range(1, alloc.size + 1))
        else:
            universe = set(range(1, alloc.num_pages + 1))
        free = self._ids(alloc.free_pages) + self._ids(alloc.release_pages)
        tree: list = []
        for node in self.tree_nodes():
            if node is self.cache.root_node:
                continue
            value = node.component_data[ComponentType.SWA].value
            if value is not None:
                tree += self._pages([i for i in self._ids(value) if i > 0])
        owners = {"allocator": free, "tree": tree}
        mapping = self.allocator.full_to_swa_index_mapping
        for rid, req in self.live_reqs.items():
            full = self._req_owned_full_slots(req)
            swa_ids = [i for i in self._ids(mapping[full]) if i > 0]
            owners[f"req {rid}"] = self._pages(swa_ids)
        self._check_partition(errors, "swa", universe, owners)

    def _check_mamba(self, errors: list) -> None:
        alloc = self.mamba_allocator
        universe = set(range(1, alloc.size + 1))
        tree: list = []
        if self.has_mamba:
            for node in self.tree_nodes():
                if node is self.cache.root_node:
                    continue
                tree += self._ids(node.component_data[ComponentType.MAMBA].value)
        owners = {"allocator": self._ids(alloc.free_slots), "tree": tree}
        for rid, req in self.live_reqs.items():
            ids = self._ids(req.mamba_pool_idx)
            ids += [i for i in self._ids(req.mamba_ping_pong_track_buffer) if i >= 0]
            owners[f"req {rid}"] = ids
        self._check_partition(errors, "mamba", universe, owners)

    def _check_req_slots(self, errors: list) -> None:
        pool = self.req_to_token_pool
        universe = set(range(1, pool.size + 1))
        owners = {"pool": list(pool.free_slots)}
        for rid, req in self.live_reqs.items():
            owners[f"req {rid}"] = [req.req_pool_idx]
        self._check_partition(errors, "req_to_token", universe, owners)


# --------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------


def _assemble(
    *,
    req_to_token_pool,
    kv_pool,
    allocator,
    page_size: int,
    tree_components: tuple,
    enable_session: bool,
    eviction_policy: str,
    sliding_window_size: Optional[int] = None,
    swa_eviction_interval: Optional[int] = 1,
) -> CacheHarness:
    """Build the real ``UnifiedRadixCache`` over the given pools and wrap it.
    ``swa_eviction_interval=None`` uses ``SGLANG_SWA_EVICTION_INTERVAL``."""
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=eviction_policy,
        enable_session_radix_cache=enable_session,
        sliding_window_size=sliding_window_size,
        tree_components=tree_components,
    )
    return CacheHarness(
        cache=UnifiedRadixCache(params),
        req_to_token_pool=req_to_token_pool,
        allocator=allocator,
        kv_pool=kv_pool,
        page_size=page_size,
        sliding_window_size=sliding_window_size,
        swa_eviction_interval=(
            envs.SGLANG_SWA_EVICTION_INTERVAL.get()
            if swa_eviction_interval is None
            else swa_eviction_interval
        ),
    )


def _full_kv_and_allocator(
    num_tokens, page_size, *, head_num, head_dim, layer_num, need_sort
):
    kv_pool = MHATokenToKVPool(
        size=num_tokens,
        page_size=page_size,
        dtype=KV_DTYPE,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device=DEVICE,
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            num_tokens, KV_DTYPE, DEVICE, kv_pool, need_sort
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            num_tokens, page_size, KV_DTYPE, DEVICE, kv_pool, need_sort
        )
    return kv_pool, allocator


def _swa_kv_and_allocator(
    num_tokens, swa_num_tokens, page_size, *, head_num, head_dim, need_sort
):
    kv_pool = SWAKVPool(
        size=num_tokens,
        size_swa=swa_num_tokens,
        page_size=page_size,
        dtype=KV_DTYPE,
        head_num=head_num,
        head_dim=head_dim,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device=DEVICE,
        enable_alt_stream=False,
    )
    allocator = SWATokenToKVPoolAllocator(
        size=num_tokens,
        size_swa=swa_num_tokens,
        page_size=page_size,
        dtype=KV_DTYPE,
        device=DEVICE,
        kvcache=kv_pool,
        need_sort=need_sort,
    )
    return kv_pool, allocator


def tiny_mamba_cache_params():
    """A deliberately tiny single-layer Mamba2 state (conv (16, 3), ssm (2, 4, 4))."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=4,
        conv_kernel=4,
    )
    return Mamba2CacheParams(shape=shape, layers=[0])


def _mamba_req_to_token_pool(max_num_reqs, max_context_len, mamba_num_slots):
    cache_params = tiny_mamba_cache_params()
    return HybridReqToTokenPool(
        size=max_num_reqs,
        mamba_size=mamba_num_slots,
        mamba_spec_state_size=mamba_num_slots,
        max_context_len=max_context_len,
        device=DEVICE,
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False,
    )


def _check_mamba_page_size(page_size: int) -> None:
    if page_size != 1:
        raise ValueError(
            "Mamba shapes need page_size=1: MambaComponent only allows page_size>1 "
            "with --enable-mamba-extra-buffer, whose ping-pong state tracking is "
            "driven by the model forward (not available in this CPU harness)."
        )


def make_full_cache(
    num_tokens: int = 256,
    page_size: int = 1,
    enable_session: bool = False,
    eviction_policy: str = "lru",
    *,
    max_num_reqs: int = 16,
    max_context_len: int = 1024,
    head_num: int = 1,
    head_dim: int = 4,
    layer_num: int = 1,
    need_sort: bool = False,
) -> CacheHarness:
    """FULL-only tree on ``ReqToTokenPool`` + ``MHATokenToKVPool`` +
    ``TokenToKVPoolAllocator`` (``PagedTokenToKVPoolAllocator`` if page_size>1)."""
    publish_server_args(page_size=page_size)
    req_to_token_pool = ReqToTokenPool(
        size=max_num_reqs,
        max_context_len=max_context_len,
        device=DEVICE,
        enable_memory_saver=False,
    )
    kv_pool, allocator = _full_kv_and_allocator(
        num_tokens, page_size, head_num=head_num, head_dim=head_dim,
        layer_num=layer_num, need_sort=need_sort,
    )
    return _assemble(
        req_to_token_pool=req_to_token_pool,
        kv_pool=kv_pool,
        allocator=allocator,
        page_size=page_size,
        tree_components=(ComponentType.FULL,),
        enable_session=enable_session,
        eviction_policy=eviction_policy,
    )


def make_swa_cache(
    num_tokens: int = 256,
    swa_num_tokens: Optional[int] = None,
    page_size: int = 4,
    sliding_window_size: int = 8,
    enable_session: bool = False,
    eviction_policy: str = "lru",
    *,
    max_num_reqs: int = 16,
    max_context_len: int = 1024,
    head_num: int = 1,
    head_dim: int = 4,
    need_sort: bool = False,
    swa_eviction_interval: Optional[int] = 1,
) -> CacheHarness:
    """FULL+SWA tree on ``SWAKVPool`` + ``SWATokenToKVPoolAllocator`` (one full
    and one sliding-window layer). ``swa_num_tokens`` defaults to ``num_tokens``.
    ``swa_eviction_interval=None`` uses ``SGLANG_SWA_EVICTION_INTERVAL``."""
    publish_server_args(page_size=page_size)
    if swa_num_tokens is None:
        swa_num_tokens = num_tokens
    req_to_token_pool = ReqToTokenPool(
        size=max_num_reqs,
        max_context_len=max_context_len,
        device=DEVICE,
        enable_memory_saver=False,
    )
    kv_pool, allocator = _swa_kv_and_allocator(
        num_tokens, swa_num_tokens, page_size,
        head_num=head_num, head_dim=head_dim, need_sort=need_sort,
    )
    return _assemble(
        req_to_token_pool=req_to_token_pool,
        kv_pool=kv_pool,
        allocator=allocator,
        page_size=page_size,
        tree_components=(ComponentType.FULL, ComponentType.SWA),
        enable_session=enable_session,
        eviction_policy=eviction_policy,
        sliding_window_size=sliding_window_size,
        swa_eviction_interval=swa_eviction_interval,
    )


def make_full_mamba_cache(
    num_tokens: int = 256,
    mamba_num_slots: int = 16,
    page_size: int = 1,
    enable_session: bool = False,
    eviction_policy: str = "lru",
    *,
    max_num_reqs: int = 8,
    max_context_len: int = 1024,
    head_num: int = 1,
    head_dim: int = 4,
    need_sort: bool = False,
) -> CacheHarness:
    """FULL+MAMBA tree on ``HybridReqToTokenPool`` (real ``MambaPool``) +
    ``MHATokenToKVPool`` + ``TokenToKVPoolAllocator``."""
    _check_mamba_page_size(page_size)
    publish_server_args(page_size=page_size)
    req_to_token_pool = _mamba_req_to_token_pool(
        max_num_reqs, max_context_len, mamba_num_slots
    )
    kv_pool, allocator = _full_kv_and_allocator(
        num_tokens, page_size, head_num=head_num, head_dim=head_dim,
        layer_num=1, need_sort=need_sort,
    )
    return _assemble(
        req_to_token_pool=req_to_token_pool,
        kv_pool=kv_pool,
        allocator=allocator,
        page_size=page_size,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        enable_session=enable_session,
        eviction_policy=eviction_policy,
    )


def make_swa_mamba_cache(
    num_tokens: int = 256,
    swa_num_tokens: Optional[int] = None,
    mamba_num_slots: int = 16,
    page_size: int = 1,
    sliding_window_size: int = 8,
    enable_session: bool = False,
    eviction_policy: str = "lru",
    *,
    max_num_reqs: int = 8,
    max_context_len: int = 1024,
    head_num: int = 1,
    head_dim: int = 4,
    need_sort: bool = False,
    swa_eviction_interval: Optional[int] = 1,
) -> CacheHarness:
    """FULL+SWA+MAMBA tree on ``HybridReqToTokenPool`` (real ``MambaPool``) +
    ``SWAKVPool`` + ``SWATokenToKVPoolAllocator``."""
    _check_mamba_page_size(page_size)
    publish_server_args(page_size=page_size)
    if swa_num_tokens is None:
        swa_num_tokens = num_tokens
    req_to_token_pool = _mamba_req_to_token_pool(
        max_num_reqs, max_context_len, mamba_num_slots
    )
    kv_pool, allocator = _swa_kv_and_allocator(
        num_tokens, swa_num_tokens, page_size,
        head_num=head_num, head_dim=head_dim, need_sort=need_sort,
    )
    return _assemble(
        req_to_token_pool=req_to_token_pool,
        kv_pool=kv_pool,
        allocator=allocator,
        page_size=page_size,
        tree_components=(ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
        enable_session=enable_session,
        eviction_policy=eviction_policy,
        sliding_window_size=sliding_window_size,
        swa_eviction_interval=swa_eviction_interval,
    )
