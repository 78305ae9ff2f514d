"""CPU replay: does the SWA retain floor let a hybrid SWA + Mamba model reuse
what it decoded?

    python -m sglang_session_cache_bench.retain_floor_replay \
        [--requests 32] [--page-size 128] [--track-intervals 256,512]

For each Mamba track interval and each floor setting (off / old / tree, see
below), a fresh real FULL + SWA + MAMBA ``UnifiedRadixCache`` (``SWAKVPool`` +
``SWATokenToKVPoolAllocator``, ``HybridReqToTokenPool`` with the Mamba
extra-buffer ping-pong slots, page_size 128) serves two rounds:

Round 1
    every conversation is prefilled (``Req.init_next_round_input`` match,
    ``inc_lock_ref``, ``alloc_req_slots``, the real
    ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` Mamba track,
    ``maybe_cache_unfinished_req``), then all of them decode together in one
    real ``ScheduleBatch``: each step runs ``ScheduleBatch.maybe_evict_swa()``
    (so the patched ``_evict_swa`` and ``free_swa_out_of_window_slots``, on
    SGLang's own ``SGLANG_SWA_EVICTION_INTERVAL`` cadence), allocates one slot
    per request, and advances ``mamba_last_track_seqlen`` whenever
    ``kv_committed_len`` reaches a multiple of the track interval (as
    ``SchedulerBatchResultProcessor._mamba_prefix_cache_update`` does). A
    request that reaches its length goes through ``release_kv_cache`` (i.e.
    ``cache_finished_req``).
Round 2
    each conversation comes back as prompt + round-1 output + a new user turn
    and is matched with ``Req.init_next_round_input``. A *decode-region hit*
    is a match longer than the original prompt; a *prefill-region hit* is a
    match that reaches at least the round-1 prompt's last checkpoint (the
    ``cache_protected_len`` its prefill's ``cache_unfinished_req`` re-match
    left, i.e. the deepest prompt prefix with a Mamba state in the tree).

Floor settings, all on the same patched code, differing only in the cache
instance's ``swa_retain_floor``:

``off``
    ``lambda req: None``: SGLang's original tail-relative eviction.
``old``
    the request checkpoint only (``mamba_last_track_seqlen - window``), i.e.
    the floor before the tree-side checkpoint was added: ``None`` from the end
    of the prefill until the first decode checkpoint.
``tree``
    the installed floor: ``max(mamba_last_track_seqlen, tree checkpoint) -
    window``, non-``None`` from the first decode step on.

What is not real (no GPU, no model): the paged allocators' Triton
``alloc_extend``/``alloc_decode`` kernels are replaced by the same index
arithmetic on their page-granular ``alloc()`` (see ``_alloc_extend`` /
``alloc_decode_slot``), sampled tokens are random, and no Mamba/KV state is
computed -- the cache bookkeeping is what is measured. ``get_server_args()``
is a dummy-boundary ``ServerArgs`` from SGLang's own
``override_server_args`` test hook (no model config is loaded).

Conversation lengths are drawn so that every decode crosses at least one
checkpoint of both intervals (the prompt ends 8..240 tokens before a multiple
of 512, the decode runs 256..480 tokens); a conversation without a checkpoint
past its prompt has no Mamba state in the decode region and could not hit
there under any SWA policy. ``eligible`` in the output counts them.
``--gap LO,HI`` moves the prompt ends (e.g. ``--gap 300,500`` puts them just
past a checkpoint, so the first decode checkpoint is far away and the three
floors differ most in what they retain before it; decodes that never reach it
are then not eligible for decode-region hits).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Optional

DEFAULT_REQUESTS = 32
DEFAULT_PAGE_SIZE = 128
DEFAULT_TRACK_INTERVALS = (256, 512)
DEFAULT_SLIDING_WINDOW = 128
DEFAULT_NEW_TURN = 64
# Tokens between the end of the prompt and the next multiple of 512.
DEFAULT_GAP = (8, 240)
# SGLang's FLA_CHUNK_SIZE; ServerArgs.mamba_cache_chunk_size = max(it, page_size).
FLA_CHUNK_SIZE = 64
DEVICE = "cpu"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    prompt: tuple  # round-1 input ids
    decode_len: int  # round-1 output tokens (the first is sampled at prefill)
    outputs: tuple  # the round-1 output ids
    new_turn: tuple  # appended in round 2


def make_conversations(
    n: int,
    *,
    seed: int = 0,
    new_turn: int = DEFAULT_NEW_TURN,
    gap: tuple = DEFAULT_GAP,
) -> list[Conversation]:
    rng = random.Random(seed)
    lo, hi = gap
    convs = []
    for i in range(n):
        # Prompt ends lo..hi (default 8..240) tokens before a multiple of 512
        # (1024 or 1536).
        prompt_len = 512 * rng.choice((2, 3)) - rng.randint(lo, hi)
        decode_len = rng.randint(256, 480)
        # Distinct first token per conversation: no cross-conversation sharing.
        prompt = (10_000 + i,) + tuple(rng.randint(1, 9_999) for _ in range(prompt_len - 1))
        outputs = tuple(rng.randint(20_000, 29_999) for _ in range(decode_len))
        turn = tuple(rng.randint(30_000, 39_999) for _ in range(new_turn))
        convs.append(Conversation(prompt, decode_len, outputs, turn))
    return convs


# --------------------------------------------------------------------------
# Real cache on CPU
# --------------------------------------------------------------------------


@dataclass
class ReplayEnv:
    cache: object
    req_to_token_pool: object
    allocator: object
    batch: object
    page_size: int
    sliding_window: int
    track_interval: int
    _server_args_override: object = None

    def close(self) -> None:
        if self._server_args_override is not None:
            self._server_args_override.restore()
            self._server_args_override = None


def build_env(
    *,
    num_requests: int,
    page_size: int,
    track_interval: int,
    sliding_window: int,
    max_context_len: int,
    floor="tree",
    enable_session: bool = True,
) -> ReplayEnv:
    """A real FULL + SWA + MAMBA ``UnifiedRadixCache`` with the Mamba extra
    buffer, sized so that nothing is evicted from the tree (the replay measures
    decode-side SWA eviction only). The retain floor is part of the session
    feature, so it needs ``enable_session`` (the cache's
    ``enable_session_radix_cache``); without it the cache is stock 0.5.16."""

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang_session_cache_bench.harness import _swa_kv_and_allocator, tiny_mamba_cache_params
    from sglang.srt.mem_cache.unified_cache_components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(
        page_size=page_size,
        mamba_radix_cache_strategy="extra_buffer",
        mamba_track_interval=track_interval,
    )
    server_args = override.install()
    try:
        # A lazily cached property that would load the model's HF config.
        server_args._mamba_cache_chunk_size = max(FLA_CHUNK_SIZE, page_size)
        assert server_args.enable_mamba_extra_buffer()

        # Room for every request's whole round-1 sequence twice over.
        num_tokens = _cdiv(2 * num_requests * max_context_len, page_size) * page_size
        kv_pool, allocator = _swa_kv_and_allocator(
            num_tokens, num_tokens, page_size, head_num=1, head_dim=4, need_sort=False
        )
        req_to_token_pool = HybridReqToTokenPool(
            size=num_requests + 2,
            # 3 per running request (active + 2 ping-pong) + tree states + COW.
            mamba_size=6 * num_requests + 8,
            mamba_spec_state_size=num_requests + 2,
            max_context_len=max_context_len,
            device=DEVICE,
            enable_memory_saver=False,
            cache_params=tiny_mamba_cache_params(),
            mamba_layer_ids=[0],
            enable_mamba_extra_buffer=True,
            enable_overlap_schedule=True,
        )
        cache = UnifiedRadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=req_to_token_pool,
                token_to_kv_pool_allocator=allocator,
                page_size=page_size,
                sliding_window_size=sliding_window,
                enable_mamba_extra_buffer=True,
                enable_session_radix_cache=enable_session,
                tree_components=(
                    ComponentType.FULL,
                    ComponentType.SWA,
                    ComponentType.MAMBA,
                ),
            )
        )
        _set_floor_mode(cache, floor)
        batch = ScheduleBatch(
            reqs=[],
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=cache,
            device=DEVICE,
        )
        batch.forward_mode = ForwardMode.DECODE
    except BaseException:
        override.restore()
        raise
    return ReplayEnv(
        cache=cache,
        req_to_token_pool=req_to_token_pool,
        allocator=allocator,
        batch=batch,
        page_size=page_size,
        sliding_window=sliding_window,
        track_interval=track_interval,
        _server_args_override=override,
    )


FLOOR_MODES = ("off", "old", "tree")


def floor_mode(floor) -> str:
    """``True`` -> ``"tree"`` (the installed floor), ``False`` -> ``"off"``."""
    if floor is True:
        return "tree"
    if floor is False:
        return "off"
    if floor not in FLOOR_MODES:
        raise ValueError(f"unknown floor setting {floor!r}; expected one of {FLOOR_MODES}")
    return floor


def _set_floor_mode(cache, floor) -> None:
    """Point this one cache instance's ``swa_retain_floor`` at the setting."""
    import types

    from sglang_session_cache.patches import swa_retain_floor as patch

    mode = floor_mode(floor)
    if mode == "off":
        # Same patched code; the floor is simply never set.
        cache.swa_retain_floor = lambda req: None
    elif mode == "old":
        cache.swa_retain_floor = types.MethodType(
            patch._request_only_swa_retain_floor, cache
        )
    # "tree": the class's (installed) swa_retain_floor.


def new_req(rid: str, token_ids, max_new_tokens: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", token_ids),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def _alloc_extend(env: ReplayEnv, req, prefix_len: int, seq_len: int) -> None:
    """``alloc_for_extend`` for one request whose prefix is page aligned:
    ``alloc_paged_token_slots_extend`` takes whole new pages for the extend
    (the Triton kernel's arithmetic when ``prefix_len % page_size == 0``) from
    both sub-allocators and maps full -> SWA slot by slot."""
    import torch

    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    ps = env.page_size
    assert prefix_len % ps == 0, prefix_len
    n = seq_len - prefix_len
    evict_from_tree_cache(env.cache, n + ps)
    full = env.allocator.full_attn_allocator.alloc(_cdiv(n, ps) * ps)
    swa = env.allocator.swa_attn_allocator.alloc(_cdiv(n, ps) * ps)
    if full is None or swa is None:
        raise RuntimeError("replay pools too small for the extend")
    full, swa = full[:n], swa[:n]
    env.allocator.set_full_to_swa_mapping(full, swa)
    pool = env.req_to_token_pool
    pool.write(
        (req.req_pool_idx, slice(0, prefix_len)), req.prefix_indices.to(torch.int32)
    )
    pool.write((req.req_pool_idx, slice(prefix_len, seq_len)), full.to(torch.int32))
    req.kv = ReqKvInfo(kv_allocated_len=seq_len, swa_evicted_seqlen=0)


def alloc_decode_slot(env: ReplayEnv, req) -> None:
    """``alloc_decode`` for one request: the next slot of the last page, or a
    fresh page from each sub-allocator at a page boundary (the kernel's
    arithmetic), then the full -> SWA mapping and the req_to_token write."""
    import torch

    ps = env.page_size
    pos = req.kv.kv_allocated_len
    row = env.req_to_token_pool.req_to_token[req.req_pool_idx]
    if pos % ps == 0:
        full = env.allocator.full_attn_allocator.alloc(ps)
        swa = env.allocator.swa_attn_allocator.alloc(ps)
        if full is None or swa is None:
            raise RuntimeError("replay pools too small for decode")
        full, swa = full[:1], swa[:1]
    else:
        full = row[pos - 1 : pos].to(torch.int64) + 1
        swa = env.allocator.full_to_swa_index_mapping[full - 1] + 1
    env.allocator.set_full_to_swa_mapping(full, swa)
    row[pos] = int(full[0])
    req.kv.kv_allocated_len += 1


def prefill(env: ReplayEnv, req, first_token: int) -> int:
    """Scheduler admission + ``prepare_for_extend`` + the post-prefill
    bookkeeping of ``process_batch_result_prefill`` for one request."""
    from sglang.srt.mem_cache.allocation import alloc_req_slots
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

    cache = env.cache
    req.init_next_round_input(cache)
    prefix_len = len(req.prefix_indices)
    seq_len = len(req.full_untruncated_fill_ids)
    req.set_extend_range(prefix_len, seq_len)
    lock = cache.inc_lock_ref(req.last_node)
    req.swa_uuid_for_lock = lock.swa_uuid_for_lock
    alloc_req_slots(env.req_to_token_pool, [req], cache)
    _alloc_extend(env, req, prefix_len, seq_len)
    req.kv_committed_len = seq_len
    req.extend_batch_idx += 1
    req.mamba_cow_src_index = None  # no state to copy without a model
    req.mamba_needs_clear = False
    # The real per-request Mamba track of prepare_for_extend (extra buffer).
    env.batch._mamba_radix_cache_v2_req_prepare_for_extend(req)
    req.output_ids.append(first_token)
    maybe_cache_unfinished_req(req, cache)
    return prefix_len


def mamba_track_after_decode(env: ReplayEnv, req) -> None:
    """``SchedulerBatchResultProcessor._mamba_prefix_cache_update`` for plain
    (non-spec, non-lazy) decode: at ``kv_committed_len % interval == 0`` the
    forward wrote a checkpoint into the ping-pong slot; record it and flip."""
    if req.kv_committed_len % env.track_interval == 0:
        req.mamba_last_track_seqlen = req.kv_committed_len
        req.mamba_next_track_idx = env.req_to_token_pool.get_mamba_ping_pong_other_idx(
            req.mamba_next_track_idx
        )


@dataclass
class _ReqTrace:
    prompt_len: int
    # Deepest prompt prefix with a Mamba state in the tree after the prefill
    # (cache_protected_len after cache_unfinished_req's re-match).
    prefill_checkpoint: int = 0
    checkpoint_at_finish: Optional[int] = None
    frontier_at_finish: int = 0
    # Sum over decode steps of request-owned live SWA slots.
    live_swa_sum: int = 0
    steps: int = 0
    matched: int = 0
    round2_len: int = 0


def run_setting(
    convs: list[Conversation],
    *,
    page_size: int,
    track_interval: int,
    sliding_window: int,
    floor="tree",
    progress: bool = True,
) -> dict:
    """Both rounds on a fresh cache; per-request traces and totals."""
    from sglang.srt.mem_cache.common import release_kv_cache

    max_len = max(len(c.prompt) + c.decode_len + len(c.new_turn) for c in convs)
    env = build_env(
        num_requests=len(convs),
        page_size=page_size,
        track_interval=track_interval,
        sliding_window=sliding_window,
        max_context_len=_cdiv(max_len + 1, page_size) * page_size,
        floor=floor,
    )
    try:
        cache, batch = env.cache, env.batch
        traces = [_ReqTrace(prompt_len=len(c.prompt)) for c in convs]

        # ---- round 1: prefill everything, then decode as one batch ----
        running = []
        for i, conv in enumerate(convs):
            req = new_req(f"r1-{i}", conv.prompt, conv.decode_len)
            prefill(env, req, conv.outputs[0])
            traces[i].prefill_checkpoint = req.cache_protected_len
            running.append((i, req))
        forward_iter = 1  # the prefill batch
        while running:
            batch.reqs = [req for _, req in running]
            batch.forward_iter = forward_iter
            batch.maybe_evict_swa()  # patched _evict_swa on the real cadence
            for _, req in running:
                alloc_decode_slot(env, req)
                req.decode_batch_idx += 1
                req.kv_committed_len += 1
            still = []
            for i, req in running:
                trace = traces[i]
                live_from = max(req.kv.swa_evicted_seqlen, req.cache_protected_len)
                trace.live_swa_sum += req.kv_committed_len - live_from
                trace.steps += 1
                mamba_track_after_decode(env, req)
                if len(req.output_ids) < convs[i].decode_len:
                    req.output_ids.append(convs[i].outputs[len(req.output_ids)])
                    still.append((i, req))
                else:
                    trace.checkpoint_at_finish = req.mamba_last_track_seqlen
                    trace.frontier_at_finish = req.kv.swa_evicted_seqlen
                    release_kv_cache(req, cache)
            running = still
            forward_iter += 1
        batch.reqs = []
        cache.sanity_check()
        swa_held_by_tree = cache.swa_evictable_size()

        # ---- round 2: re-send prompt + output + new turn, match ----
        mamba_alloc = env.req_to_token_pool.mamba_allocator
        for i, conv in enumerate(convs):
            ids = conv.prompt + conv.outputs + conv.new_turn
            req = new_req(f"r2-{i}", ids, 1)
            req.init_next_round_input(cache)
            traces[i].matched = len(req.prefix_indices)
            traces[i].round2_len = len(ids)
            if req.mamba_pool_idx is not None:  # copy-on-write target of the match
                mamba_alloc.free(req.mamba_pool_idx.unsqueeze(0))
                req.mamba_pool_idx = None
    finally:
        env.close()

    eligible = sum(
        1
        for t in traces
        if t.checkpoint_at_finish is not None and t.checkpoint_at_finish > t.prompt_len
    )
    prefill_eligible = sum(1 for t in traces if t.prefill_checkpoint > 0)
    prefill_hits = sum(
        1 for t in traces if t.prefill_checkpoint > 0 and t.matched >= t.prefill_checkpoint
    )
    hits = sum(1 for t in traces if t.matched > t.prompt_len)
    reused = sum(t.matched for t in traces)
    recomputed = sum(t.round2_len - t.matched for t in traces)
    mode = floor_mode(floor)
    if progress:
        _log(
            f"  interval={track_interval} floor={mode}: {prefill_hits}/{len(convs)} "
            f"prefill-region hits, {hits}/{len(convs)} decode-region hits"
        )
    return {
        "track_interval": track_interval,
        "floor": mode,
        "requests": len(convs),
        "prefill_eligible": prefill_eligible,
        "prefill_region_hits": prefill_hits,
        "eligible": eligible,
        "decode_region_hits": hits,
        "reused_tokens": reused,
        "recomputed_tokens": recomputed,
        "swa_tokens_held_by_tree": swa_held_by_tree,
        "traces": traces,
    }


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m sglang_session_cache_bench.retain_floor_replay",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument(
        "--track-intervals",
        default=",".join(str(x) for x in DEFAULT_TRACK_INTERVALS),
        help="comma-separated Mamba track intervals (multiples of the page size)",
    )
    p.add_argument("--sliding-window", type=int, default=DEFAULT_SLIDING_WINDOW)
    p.add_argument("--new-turn", type=int, default=DEFAULT_NEW_TURN)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gap",
        default=",".join(str(x) for x in DEFAULT_GAP),
        help="LO,HI: the prompt ends LO..HI tokens before a multiple of 512",
    )
    args = p.parse_args(argv)
    args.track_intervals = [int(x) for x in args.track_intervals.split(",") if x]
    try:
        lo, hi = (int(x) for x in args.gap.split(","))
    except ValueError:
        p.error(f"--gap must be LO,HI, got {args.gap!r}")
    if not 1 <= lo <= hi <= 511:
        p.error(f"--gap needs 1 <= LO <= HI <= 511, got {args.gap!r}")
    args.gap = (lo, hi)
    for interval in args.track_intervals:
        if interval <= 0 or interval % args.page_size:
            p.error(f"track interval {interval} is not a multiple of --page-size")
    return args


def _summary(off: dict, on: dict) -> dict:
    """``on`` minus ``off``, per request (same workload, same schedule)."""
    n = on["requests"]
    at_finish = [
        t_off.frontier_at_finish - t_on.frontier_at_finish
        for t_off, t_on in zip(off["traces"], on["traces"])
    ]
    live = [
        (t_on.live_swa_sum - t_off.live_swa_sum) / max(1, t_on.steps)
        for t_off, t_on in zip(off["traces"], on["traces"])
    ]
    return {
        "extra_swa_slots_per_req_at_finish_mean": sum(at_finish) / n,
        "extra_swa_slots_per_req_at_finish_max": max(at_finish),
        "extra_live_swa_slots_per_req_decode_mean": sum(live) / n,
    }


def main(argv=None) -> dict:
    args = _parse_args(argv)
    from sglang.srt.environ import envs

    convs = make_conversations(
        args.requests, seed=args.seed, new_turn=args.new_turn, gap=args.gap
    )
    eviction_interval = envs.SGLANG_SWA_EVICTION_INTERVAL.get()
    _log(
        f"retain-floor replay: {args.requests} conversations, page_size={args.page_size}, "
        f"sliding_window={args.sliding_window}, track intervals {args.track_intervals}, "
        f"SGLANG_SWA_EVICTION_INTERVAL={eviction_interval}"
    )
    results: dict = {
        "requests": args.requests,
        "page_size": args.page_size,
        "sliding_window": args.sliding_window,
        "swa_eviction_interval": eviction_interval,
        "gap": args.gap,
        "intervals": {},
    }
    t0 = time.perf_counter()
    for interval in args.track_intervals:
        per_floor = {
            mode: run_setting(
                convs,
                page_size=args.page_size,
                track_interval=interval,
                sliding_window=args.sliding_window,
                floor=mode,
            )
            for mode in FLOOR_MODES
        }
        entry: dict = {}
        for key, res in per_floor.items():
            entry[key] = {k: v for k, v in res.items() if k != "traces"}
        # Extra SWA retention of each floor against no floor, and of the tree
        # checkpoint against the request-only floor.
        entry["extra_vs_off"] = {
            mode: _summary(per_floor["off"], per_floor[mode]) for mode in ("old", "tree")
        }
        entry["tree_vs_old"] = _summary(per_floor["old"], per_floor["tree"])
        results["intervals"][interval] = entry
    results["seconds"] = round(time.perf_counter() - t0, 2)

    _print_table(results)
    return results


def _print_table(results: dict) -> None:
    n = results["requests"]
    print(
        f"SWA retain floor replay: {n} conversations, page_size={results['page_size']}, "
        f"sliding_window={results['sliding_window']}, "
        f"SGLANG_SWA_EVICTION_INTERVAL={results['swa_eviction_interval']}, "
        f"prompt ends {results['gap'][0]}..{results['gap'][1]} tokens before a "
        f"multiple of 512"
    )
    print(
        "floor: off = none (SGLang's tail-relative eviction), old = request checkpoint "
        "only, tree = max(request, tree-side checkpoint);\n"
        "prefill-hits: round-2 matches reaching the round-1 prompt's last checkpoint; "
        "decode-hits: round-2 matches longer than the round-1 prompt;\n"
        "eligible: conversations with a Mamba checkpoint past their prompt; "
        "reused / recomputed: round-2 input tokens matched / left to prefill;\n"
        "tree-SWA: SWA tokens cached in the tree after round 1"
    )
    print(
        f"{'interval':>8} {'floor':>5} {'prefill-hits':>12} {'eligible':>8} "
        f"{'decode-hits':>11} {'reused':>8} {'recomputed':>10} {'tree-SWA':>8}"
    )
    for interval, entry in results["intervals"].items():
        for key in FLOOR_MODES:
            r = entry[key]
            print(
                f"{interval:>8} {key:>5} {r['prefill_region_hits']:>9}/{n:<2} "
                f"{r['eligible']:>5}/{n:<2} "
                f"{r['decode_region_hits']:>8}/{n:<2} {r['reused_tokens']:>8} "
                f"{r['recomputed_tokens']:>10} {r['swa_tokens_held_by_tree']:>8}"
            )
        for label, s in (
            ("old vs off", entry["extra_vs_off"]["old"]),
            ("tree vs off", entry["extra_vs_off"]["tree"]),
            ("tree vs old", entry["tree_vs_old"]),
        ):
            print(
                f"{'':>8} extra SWA slots per request, {label:<11}: "
                f"at finish mean {s['extra_swa_slots_per_req_at_finish_mean']:.1f}, "
                f"max {s['extra_swa_slots_per_req_at_finish_max']}; "
                f"live during decode mean {s['extra_live_swa_slots_per_req_decode_mean']:.1f}"
            )
    print(f"({results['seconds']} s)")


if __name__ == "__main__":
    main()
