"""Op-by-op traces for the flag-off equivalence test (issue 12 item 2).

Each ``trace_*`` function drives a real sglang 0.5.16 cache of one shape
through a fixed, seeded sequence of scheduler operations with
``--enable-session-radix-cache`` off and returns, after every operation, the
observable state as plain data: eviction results, every allocator's free
count, every component's evictable/protected size, per-request SWA eviction
frontiers and, periodically, the tree itself. ``test_flag_off_equivalence``
runs each in two fresh interpreters -- patched (the ``.pth`` hook and the
plugin active) and stock (``SGLANG_SESSION_CACHE_DISABLE=1``) -- and compares
the two traces element by element.

    python flag_off_ops.py SHAPE   # prints the JSON trace as the last line
"""

from __future__ import annotations

import json
import random
import sys


def _sizes(cache, allocator, req_to_token_pool) -> list:
    out = [cache.full_evictable_size(), cache.full_protected_size()]
    if cache.supports_swa():
        out += [cache.swa_evictable_size(), cache.swa_protected_size(),
                allocator.full_available_size(), allocator.swa_available_size()]
    else:
        out.append(allocator.available_size())
    if cache.supports_mamba():
        out += [cache.mamba_evictable_size(), cache.mamba_protected_size(),
                req_to_token_pool.mamba_allocator.available_size()]
    return out


def _tree(cache) -> list:
    """Token paths of every node and which components hold data there."""
    out, stack = [], [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + tuple(node.key.token_ids) if node.key is not None else prefix
        if node is not cache.root_node:
            out.append([list(path), [node.component_data[ct].value is not None
                                     for ct in cache.tree_components]])
        stack.extend((c, path) for c in node.children.values())
    return sorted(out)


def _harness(shape: str):
    from sglang_session_cache_bench import harness as hm

    if shape == "full":
        return hm.make_full_cache(num_tokens=160, page_size=1)
    if shape == "full_paged":
        return hm.make_full_cache(num_tokens=192, page_size=4)
    if shape == "full_swa":
        return hm.make_swa_cache(num_tokens=192, swa_num_tokens=144, page_size=1,
                                 sliding_window_size=8)
    if shape == "full_mamba":
        return hm.make_full_mamba_cache(num_tokens=192, mamba_num_slots=24)
    if shape == "full_swa_mamba":
        return hm.make_swa_mamba_cache(num_tokens=192, swa_num_tokens=160, mamba_num_slots=24,
                                       sliding_window_size=8)
    raise ValueError(shape)


def trace_harness(shape: str, ops: int = 160, seed: int = 11) -> list:
    """Admissions (with tree eviction when short), chunked prefill, decode
    (SWA out-of-window frees), finishes, explicit evictions and direct
    ``alloc_token_slots`` admissions, with and without session ids."""
    from sglang.srt.mem_cache import allocation

    rng = random.Random(seed)
    h = _harness(shape)
    ps = h.page_size
    bases = [[1] * 8, [2] * 12, [3] * 4 + [4] * 4]
    live, trace = [], []
    for step in range(ops):
        kind = rng.choice(["start", "start", "decode", "decode", "finish", "evict", "admit"])
        if kind == "start" and len(live) < 3:
            tokens = rng.choice(bases) + [rng.randrange(5, 40) for _ in range(rng.randint(2, 14))]
            req = h.new_req(tokens, session_id=rng.choice([None, "s1", "s2"]))
            chunk = rng.choice([None, 4 * ps]) if len(tokens) > 8 * ps else None
            result = h.prefill(req, chunk_size=chunk)
            live.append(req)
        elif kind == "decode" and live:
            req = rng.choice(live)
            h.decode(req, rng.randint(1, 3))
            result = [req.kv.swa_evicted_seqlen, req.kv_committed_len]
        elif kind == "finish" and live:
            req = live.pop(rng.randrange(len(live)))
            h.finish(req)
            result = None
        elif kind == "evict":
            res = h.evict(num_tokens=rng.randint(1, 24), swa_num_tokens=rng.randint(0, 12),
                          mamba_num=rng.randint(0, 2) if h.cache.supports_mamba() else 0)
            result = [res.num_tokens_evicted, res.swa_num_tokens_evicted, res.mamba_num_evicted]
        elif kind == "admit":
            n = rng.randint(1, 6) * 4 * ps
            out = allocation.alloc_token_slots(h.cache, n)  # evict_from_tree_cache when short
            result = None if out is None else len(out)
            if out is not None:
                h.allocator.free(out)
        else:
            continue
        row = [step, kind, result, _sizes(h.cache, h.allocator, h.req_to_token_pool)]
        if step % 10 == 9:
            row.append(_tree(h.cache))
        trace.append(row)
    for req in live:
        h.finish(req)
    trace.append(["drain", _sizes(h.cache, h.allocator, h.req_to_token_pool), _tree(h.cache)])
    return trace


def trace_extra_buffer(seed: int = 3) -> list:
    """FULL + SWA + MAMBA with the Mamba extra buffer (page 128): the replay's
    real ``ScheduleBatch.maybe_evict_swa`` decode loop, a finish per request,
    a second-round match, then tree evictions."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang_session_cache_bench import retain_floor_replay as replay

    convs = replay.make_conversations(4, seed=seed)
    page = 128
    max_len = max(len(c.prompt) + c.decode_len + len(c.new_turn) for c in convs)
    env = replay.build_env(num_requests=len(convs), page_size=page, track_interval=256,
                           sliding_window=128,
                           max_context_len=-(-(max_len + 1) // page) * page,
                           enable_session=False)
    trace = []
    try:
        cache, batch = env.cache, env.batch

        def sizes():
            return _sizes(cache, env.allocator, env.req_to_token_pool)

        running = []
        for i, conv in enumerate(convs):
            req = replay.new_req(f"r1-{i}", conv.prompt, conv.decode_len)
            trace.append(["prefill", replay.prefill(env, req, conv.outputs[0]), sizes()])
            running.append((i, req))
        forward_iter = 1
        while running:
            batch.reqs = [req for _, req in running]
            batch.forward_iter = forward_iter
            batch.maybe_evict_swa()
            for _, req in running:
                replay.alloc_decode_slot(env, req)
                req.decode_batch_idx += 1
                req.kv_committed_len += 1
            frontiers = [req.kv.swa_evicted_seqlen for _, req in running]
            still = []
            for i, req in running:
                replay.mamba_track_after_decode(env, req)
                if len(req.output_ids) < convs[i].decode_len:
                    req.output_ids.append(convs[i].outputs[len(req.output_ids)])
                    still.append((i, req))
                else:
                    release_kv_cache(req, cache)
            trace.append(["decode", forward_iter, frontiers, sizes()])
            running = still
            forward_iter += 1
        batch.reqs = []
        trace.append(["tree", _tree(cache)])
        for i, conv in enumerate(convs):
            req = replay.new_req(f"r2-{i}", conv.prompt + conv.outputs + conv.new_turn, 1)
            req.init_next_round_input(cache)
            trace.append(["match", len(req.prefix_indices)])
            if req.mamba_pool_idx is not None:
                env.req_to_token_pool.mamba_allocator.free(req.mamba_pool_idx.unsqueeze(0))
                req.mamba_pool_idx = None
        for n in (256, 512, 1024):
            res = cache.evict(EvictParams(num_tokens=n, swa_num_tokens=n // 2, mamba_num=1))
            trace.append(["evict", [res.num_tokens_evicted, res.swa_num_tokens_evicted,
                                    res.mamba_num_evicted], sizes(), _tree(cache)])
    finally:
        env.close()
    return trace


def trace_pool_sizes() -> list:
    """``HybridSWAPoolConfigurator`` sizes for a server where the SWA retain
    floor's sizing would apply (SWA + Mamba, extra buffer, radix cache, a small
    ``swa_full_tokens_ratio``) except that the session flag is off."""
    import test_swa_pool_sizing as sizing_tests
    from sglang.srt.model_executor import pool_configurator as pc
    from sglang.srt.runtime_context import get_parallel

    overrides, out = [], []
    try:
        with get_parallel().override(attn_tp_size=1):
            for ratio in (0.05, 0.2, 0.8):
                kvc = sizing_tests.build_kvc(overrides, swa_full_tokens_ratio=ratio,
                                             enable_session_radix_cache=False)
                configurator = pc.create_memory_pool_configurator(kvc)
                for budget in (10**8, 10**9, 4 * 10**9):
                    config = configurator.calculate_pool_sizes(budget, sizing_tests.PAGE)
                    out.append([ratio, budget, repr(config)])
                for tokens in (4096, 65536, 262144):
                    try:  # SGLang's own errors (pool too small) are part of the trace
                        got = repr(configurator.calculate_pool_sizes_from_max_tokens(
                            tokens, sizing_tests.PAGE))
                    except ValueError as exc:
                        got = f"ValueError: {exc}"
                    out.append([ratio, tokens, got])
    finally:
        for override in reversed(overrides):
            override.restore()
    return out


def trace_server_args() -> list:
    """``vars(ServerArgs)`` -- what ``/get_server_info`` returns for each
    scheduler -- built as a keyword call and from a stock command line."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    built = {
        "keywords": ServerArgs(model_path="dummy", mem_fraction_static=0.5),
        "cli": ServerArgs.from_cli_args(parser.parse_args(
            ["--model-path", "dummy", "--served-model-name", "m", "--mem-fraction-static", "0.5"])),
    }
    return [[how, sorted((k, repr(v)) for k, v in vars(args).items())]
            for how, args in built.items()]


HARNESS_SHAPES = ("full", "full_paged", "full_swa", "full_mamba", "full_swa_mamba")
SHAPES = HARNESS_SHAPES + ("extra_buffer", "pool_sizes", "server_args")


def trace(shape: str) -> list:
    if shape == "extra_buffer":
        return trace_extra_buffer()
    if shape == "pool_sizes":
        return trace_pool_sizes()
    if shape == "server_args":
        return trace_server_args()
    return trace_harness(shape)


def run(shapes) -> dict:
    """One interpreter for all shapes (the sglang import dominates the cost);
    an exception is recorded as that shape's trace, so both runs compare it."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    traces = {}
    for shape in shapes:
        try:
            traces[shape] = trace(shape)
        except Exception as exc:
            traces[shape] = f"{type(exc).__name__}: {exc}"
    return {"patched": hasattr(UnifiedRadixCache, "session_ref_tracker"), "traces": traces}


if __name__ == "__main__":
    result = run(SHAPES if sys.argv[1] == "all" else sys.argv[1].split(","))
    sys.stdout.write("\n" + json.dumps(result) + "\n")
