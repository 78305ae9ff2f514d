"""SWA retain floor (issue 5) on real SGLang 0.5.16 objects, on CPU.

``free_swa_out_of_window_slots`` runs on real ``Req`` / ``ReqToTokenPool`` /
``SWATokenToKVPoolAllocator`` + ``SWAKVPool`` (the pools of cache_fixtures'
``make_swa_cache``); ``swa_retain_floor`` on the real caches of every shape;
the two call sites (``ScheduleBatch._evict_swa``,
``SWAComponent.free_out_of_window_slots``) and the decode-region reuse they
enable on a real FULL + SWA + MAMBA ``UnifiedRadixCache`` with the Mamba extra
buffer at page_size 128 (the replay's environment); the tree-side checkpoint
(the prefill region: ``cache_unfinished_req`` clears the request field, the
re-matched Mamba node stands in for it) on the same environment, and its
absence without the extra buffer or without SWA + Mamba.
"""

import inspect
import os
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402

from cache_fixtures import (  # noqa: E402
    make_full_cache,
    make_full_mamba_cache,
    make_swa_cache,
    make_swa_mamba_cache,
    release_server_args,
)
from sglang.srt.managers import schedule_batch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache import common  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import swa_component  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang_session_cache.activation import applied_patches  # noqa: E402
from sglang_session_cache_bench import retain_floor_replay as replay  # noqa: E402
from sglang_session_cache.patches import swa_retain_floor as patch  # noqa: E402
from sglang_session_cache.patches._wrap import PATCHED_FLAG  # noqa: E402

WINDOW = 8
PATCHED = common.free_swa_out_of_window_slots
ORIGINAL = PATCHED.__wrapped__


@pytest.fixture(scope="module", autouse=True)
def _server_args():
    yield
    release_server_args()


# --------------------------------------------------------------------------
# A running request on real SWA pools, no tree involved (cache_protected_len 0)
# --------------------------------------------------------------------------


def _req(token_ids, rid="r") -> Req:
    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", token_ids),
        sampling_params=SamplingParams(max_new_tokens=1, ignore_eos=True),
    )


def running(page_size: int, seq_len: int = 64):
    """(harness, req): ``req`` owns ``seq_len`` full + SWA slots, all live."""
    h = make_swa_cache(num_tokens=256, page_size=page_size, sliding_window_size=WINDOW)
    req = _req(range(1, seq_len + 1))
    h.req_to_token_pool.alloc([req])
    n_alloc = -(-seq_len // page_size) * page_size
    full = h.allocator.full_attn_allocator.alloc(n_alloc)[:seq_len]
    swa = h.allocator.swa_attn_allocator.alloc(n_alloc)[:seq_len]
    h.allocator.set_full_to_swa_mapping(full, swa)
    h.req_to_token_pool.write((req.req_pool_idx, slice(0, seq_len)), full.to(torch.int32))
    req.kv = ReqKvInfo(kv_allocated_len=seq_len, swa_evicted_seqlen=0)
    req.kv_committed_len = seq_len
    return h, req


def evict(fn, h, req, pre_len, **kw):
    fn(
        req,
        pre_len,
        sliding_window_size=WINDOW,
        page_size=h.page_size,
        req_to_token_pool=h.req_to_token_pool,
        token_to_kv_pool_allocator=h.allocator,
        **kw,
    )


def state(h, req) -> list:
    """Everything eviction can touch, as tensors/ints (compared exactly)."""
    a = h.allocator
    return [
        req.kv.swa_evicted_seqlen,
        a.full_to_swa_index_mapping.clone(),
        a.swa_attn_allocator.free_pages.clone(),
        a.swa_attn_allocator.release_pages.clone(),
        a.full_attn_allocator.free_pages.clone(),
        a.full_attn_allocator.release_pages.clone(),
        h.req_to_token_pool.req_to_token[req.req_pool_idx].clone(),
    ]


def assert_same_state(s1, s2):
    assert len(s1) == len(s2)
    for x, y in zip(s1, s2):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def live_swa(h, req) -> list:
    """Positions of ``req`` whose SWA slot is still mapped."""
    full = h.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv.kv_allocated_len]
    mapped = h.allocator.full_to_swa_index_mapping[full.to(torch.int64)] > 0
    return mapped.nonzero().flatten().tolist()


def expected_frontier(pre_len, floor, page_size):
    threshold = pre_len - max(WINDOW, page_size)
    if floor is not None:
        threshold = min(threshold, floor)
    return max(0, threshold) // page_size * page_size


# --------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------


def test_patches_installed():
    names = set(applied_patches())
    for name in (
        "common.swa_retain_floor",
        "base_prefix_cache.swa_retain_floor",
        "unified_radix_cache.swa_retain_floor",
        "swa_component.swa_retain_floor",
        "schedule_batch.swa_retain_floor",
    ):
        assert name in names
    assert getattr(PATCHED, PATCHED_FLAG, False)
    params = inspect.signature(PATCHED).parameters
    assert params["retain_floor"].default is None
    assert params["retain_floor"].kind is inspect.Parameter.KEYWORD_ONLY
    # The from-imports of both call-site modules bound the patched function.
    assert schedule_batch.free_swa_out_of_window_slots is PATCHED
    assert swa_component.free_swa_out_of_window_slots is PATCHED
    assert getattr(ScheduleBatch._evict_swa, PATCHED_FLAG, False)
    assert getattr(swa_component.SWAComponent.free_out_of_window_slots, PATCHED_FLAG, False)
    assert "swa_retain_floor" in BasePrefixCache.__dict__
    assert "swa_retain_floor" in UnifiedRadixCache.__dict__


# --------------------------------------------------------------------------
# free_swa_out_of_window_slots
# --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("is_chunk_cache", [False, True])
def test_none_is_the_original(page_size, is_chunk_cache):
    """retain_floor=None (explicit or default) leaves exactly the state the
    original leaves, call after call, on identical fresh state."""
    runs = [running(page_size) for _ in range(3)]
    for pre_len in (5, 20, 21, 40, 33, 63, 63):
        evict(ORIGINAL, *runs[0], pre_len, is_chunk_cache=is_chunk_cache)
        evict(PATCHED, *runs[1], pre_len, is_chunk_cache=is_chunk_cache)
        evict(PATCHED, *runs[2], pre_len, is_chunk_cache=is_chunk_cache, retain_floor=None)
        reference = state(*runs[0])
        assert_same_state(reference, state(*runs[1]))
        assert_same_state(reference, state(*runs[2]))
    assert runs[0][1].kv.swa_evicted_seqlen > 0  # it did evict


def test_none_forwards_the_arguments_unchanged():
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))

    wrapper = patch._wrap_free_swa_out_of_window_slots(spy)
    kwargs = dict(
        sliding_window_size=WINDOW,
        page_size=4,
        req_to_token_pool="pool",
        token_to_kv_pool_allocator="alloc",
    )
    wrapper("req", 61, **kwargs)
    wrapper("req", 61, is_chunk_cache=True, retain_floor=3, **kwargs)
    assert seen == [
        (("req", 61), {**kwargs, "is_chunk_cache": False}),
        (("req", 61), {**kwargs, "is_chunk_cache": True}),
    ]


@pytest.mark.parametrize("page_size", [1, 4, 16])  # 16: page larger than the window
def test_floor_clamps_the_threshold(page_size):
    h, req = running(page_size)
    swa_free = h.allocator.swa_available_size()
    full_free = h.allocator.full_available_size()
    evict(PATCHED, h, req, 63, retain_floor=21)
    frontier = expected_frontier(63, 21, page_size)  # 21 / 20 / 16
    assert frontier < expected_frontier(63, None, page_size)
    assert req.kv.swa_evicted_seqlen == frontier
    assert live_swa(h, req) == list(range(frontier, 64))
    assert h.allocator.swa_available_size() == swa_free + frontier
    assert h.allocator.full_available_size() == full_free  # full KV untouched


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_clamp_equals_min_of_threshold_and_floor(page_size):
    """Lowering pre_len is exactly min(threshold, floor) for every combination."""
    for pre_len in range(0, 64, 3):
        for floor in range(0, 70, 5):
            h, req = running(page_size)
            evict(PATCHED, h, req, pre_len, retain_floor=floor)
            assert req.kv.swa_evicted_seqlen == expected_frontier(pre_len, floor, page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_floor_at_or_above_threshold_is_inert(page_size):
    pre_len = 63
    threshold = pre_len - max(WINDOW, page_size)
    for floor in (threshold, threshold + 1, 63, 10_000):
        (h0, r0), (h1, r1) = running(page_size), running(page_size)
        evict(ORIGINAL, h0, r0, pre_len)
        evict(PATCHED, h1, r1, pre_len, retain_floor=floor)
        assert_same_state(state(h0, r0), state(h1, r1))


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_ignores_the_floor(page_size):
    (h0, r0), (h1, r1) = running(page_size), running(page_size)
    evict(ORIGINAL, h0, r0, 63, is_chunk_cache=True)
    evict(PATCHED, h1, r1, 63, is_chunk_cache=True, retain_floor=0)
    assert r1.kv.swa_evicted_seqlen == (63 - WINDOW) // page_size * page_size
    assert_same_state(state(h0, r0), state(h1, r1))


@pytest.mark.parametrize("page_size", [1, 4])
def test_frontier_never_moves_back(page_size):
    """Decreasing floors (and shorter pre_len) free nothing twice; the
    frontier stays put, page aligned, until the threshold passes it."""
    h, req = running(page_size)
    evict(PATCHED, h, req, 63, retain_floor=40)
    assert req.kv.swa_evicted_seqlen == 40
    snapshot = state(h, req)
    swa_free = h.allocator.swa_available_size()
    for pre_len, floor in ((63, 30), (63, 12), (50, 4), (63, 0), (20, None), (63, 40)):
        evict(PATCHED, h, req, pre_len, retain_floor=floor)
        assert req.kv.swa_evicted_seqlen == 40
        assert h.allocator.swa_available_size() == swa_free
        assert_same_state(snapshot, state(h, req))
    # The floor rising (or going away) moves it forward, freeing only the gap.
    evict(PATCHED, h, req, 63, retain_floor=48)
    assert req.kv.swa_evicted_seqlen == 48
    assert h.allocator.swa_available_size() == swa_free + 8
    evict(PATCHED, h, req, 63)
    tail = expected_frontier(63, None, page_size)
    assert req.kv.swa_evicted_seqlen == tail and tail % page_size == 0
    assert h.allocator.swa_available_size() == swa_free + tail - 40
    assert live_swa(h, req) == list(range(tail, 64))
    free = h.allocator.swa_attn_allocator.free_pages
    assert len(torch.unique(free)) == len(free)  # no slot freed twice


# --------------------------------------------------------------------------
# swa_retain_floor
# --------------------------------------------------------------------------


def _checkpointed_req(checkpoint):
    req = _req(range(1, 10))
    req.mamba_last_track_seqlen = checkpoint
    return req


@pytest.mark.parametrize(
    "make", [make_full_cache, make_swa_cache, make_full_mamba_cache], ids=["full", "swa", "full_mamba"]
)
def test_no_floor_without_both_swa_and_mamba(make):
    cache = make().cache
    assert isinstance(cache, UnifiedRadixCache)
    for checkpoint in (None, 0, 512):
        assert cache.swa_retain_floor(_checkpointed_req(checkpoint)) is None


def test_no_floor_on_other_caches():
    h = make_swa_cache()
    chunk = ChunkCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=h.req_to_token_pool,
            token_to_kv_pool_allocator=h.allocator,
            page_size=h.page_size,
        )
    )
    assert chunk.swa_retain_floor(_checkpointed_req(512)) is None


def test_no_floor_without_the_session_flag():
    # Flag off = stock 0.5.16: decode frees SWA slots relative to the tail.
    cache = make_swa_mamba_cache(sliding_window_size=WINDOW, enable_session=False).cache
    assert cache.swa_retain_floor(_checkpointed_req(100)) is None


def test_swa_mamba_floor_is_checkpoint_minus_window():
    cache = make_swa_mamba_cache(sliding_window_size=WINDOW, enable_session=True).cache
    assert cache.swa_retain_floor(_checkpointed_req(100)) == 100 - WINDOW
    assert cache.swa_retain_floor(_checkpointed_req(WINDOW)) == 0
    assert cache.swa_retain_floor(_checkpointed_req(3)) == 0  # clamped at 0
    assert cache.swa_retain_floor(_checkpointed_req(None)) is None
    cache.disable = True  # nothing will be inserted: nothing to keep
    assert cache.swa_retain_floor(_checkpointed_req(100)) is None


# --------------------------------------------------------------------------
# Call sites, on the replay's FULL + SWA + MAMBA extra-buffer cache (page 128)
# --------------------------------------------------------------------------

PAGE, SWA_WINDOW, INTERVAL = 128, 128, 256
PROMPT = 1000  # prefill checkpoint 896 (= 7 pages), inserted by cache_unfinished_req


def _decoding(env, n_decode):
    """A request prefilled with PROMPT tokens and decoded ``n_decode`` steps
    with no SWA eviction yet; Mamba checkpoints advance every INTERVAL."""
    req = replay.new_req("r1", list(range(1, PROMPT + 1)), n_decode + 1)
    replay.prefill(env, req, first_token=50_000)
    assert req.cache_protected_len == 896 and req.mamba_last_track_seqlen is None
    for step in range(n_decode):
        replay.alloc_decode_slot(env, req)
        req.decode_batch_idx += 1
        req.kv_committed_len += 1
        replay.mamba_track_after_decode(env, req)
        req.output_ids.append(50_001 + step)
    return req


@pytest.fixture(params=[True, False], ids=["floor", "no_floor"])
def env(request):
    e = replay.build_env(
        num_requests=2,
        page_size=PAGE,
        track_interval=INTERVAL,
        sliding_window=SWA_WINDOW,
        max_context_len=2048,
        floor=request.param,
    )
    e.floor = request.param
    yield e
    e.close()


def test_decode_call_site_and_decode_region_reuse(env):
    req = _decoding(env, 530)  # KV for 1530 tokens; checkpoints 1024, 1280
    assert req.kv_committed_len == 1530 and req.mamba_last_track_seqlen == 1280
    floor = env.cache.swa_retain_floor(req)
    assert floor == (1280 - SWA_WINDOW if env.floor else None)

    swa_free = env.allocator.swa_available_size()
    env.batch.reqs = [req]
    env.batch._evict_swa(req, req.seqlen - 1)  # what maybe_evict_swa calls
    frontier = 1152 if env.floor else (1530 - 128) // PAGE * PAGE  # 1280 without
    assert req.kv.swa_evicted_seqlen == frontier
    assert env.allocator.swa_available_size() == swa_free + frontier - 896

    # Finish, then come back with the conversation plus a new turn.
    release_kv_cache(req, env.cache)
    env.cache.sanity_check()
    ids = list(req.origin_input_ids) + list(req.output_ids) + [60_000 + i for i in range(64)]
    again = replay.new_req("r2", ids, 1)
    again.init_next_round_input(env.cache)
    # With the floor the window under the 1280 checkpoint survived: the match
    # ends there, past the prompt. Without it, only the prefill checkpoint.
    assert len(again.prefix_indices) == (1280 if env.floor else 896)


def test_chunked_prefill_call_site(env):
    req = _decoding(env, 530)
    component = env.cache.components[ComponentType.SWA]
    params = InsertParams()
    component.free_out_of_window_slots(req, req.kv_committed_len, params)
    assert req.kv.swa_evicted_seqlen == (1152 if env.floor else 1280)
    assert params.swa_evicted_seqlen == req.kv.swa_evicted_seqlen
    release_kv_cache(req, env.cache)
    env.cache.sanity_check()


# --------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------


def test_replay_main_small():
    results = replay.main(["--requests", "3", "--track-intervals", "512"])
    entry = results["intervals"][512]
    for mode in ("off", "old", "tree"):
        assert entry[mode]["floor"] == mode
        assert entry[mode]["prefill_eligible"] == 3
        assert entry[mode]["prefill_region_hits"] == 3  # the tree owns that window
    for mode in ("old", "tree"):
        assert entry[mode]["eligible"] == 3
        assert entry[mode]["decode_region_hits"] == 3
        assert entry["off"]["decode_region_hits"] <= entry[mode]["decode_region_hits"]
        assert entry[mode]["reused_tokens"] >= entry["off"]["reused_tokens"]
        assert entry["extra_vs_off"][mode]["extra_swa_slots_per_req_at_finish_mean"] >= 0
    # The tree checkpoint only ever keeps more than the request-only floor.
    assert entry["tree_vs_old"]["extra_swa_slots_per_req_at_finish_mean"] >= 0
    assert entry["tree_vs_old"]["extra_live_swa_slots_per_req_decode_mean"] >= 0


def test_replay_floor_settings():
    assert [replay.floor_mode(x) for x in (True, False, "off", "old", "tree")] == [
        "tree", "off", "off", "old", "tree"
    ]
    with pytest.raises(ValueError):
        replay.floor_mode("on")
    with pytest.raises(SystemExit):
        replay._parse_args(["--gap", "0,10"])
    convs = replay.make_conversations(4, gap=(300, 500))
    assert all(12 <= 512 - len(c.prompt) % 512 <= 500 for c in convs)
    # The default gap keeps the original workload (same draws, same lengths).
    assert replay.make_conversations(5) == replay.make_conversations(5, gap=(8, 240))


# --------------------------------------------------------------------------
# Tree-side checkpoint: the prefill region
# --------------------------------------------------------------------------

# Prompt 1040: the prefill tracks its Mamba state at 1024 (page/chunk floor),
# cache_unfinished_req inserts [0, 1024) and clears mamba_last_track_seqlen;
# the first decode checkpoint (interval 512) is 1536.
LONG_PROMPT, LONG_INTERVAL = 1040, 512
PREFILL_CKPT, FIRST_DECODE_CKPT = 1024, 1536


def _depth(node):
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


@pytest.fixture(params=["tree", "old", "off"])
def long_env(request):
    e = replay.build_env(
        num_requests=2,
        page_size=PAGE,
        track_interval=LONG_INTERVAL,
        sliding_window=SWA_WINDOW,
        max_context_len=2048,
        floor=request.param,
    )
    e.floor = request.param
    yield e
    e.close()


def _prefilled(env, prompt_len=LONG_PROMPT, rid="r1", max_new_tokens=600):
    req = replay.new_req(rid, list(range(1, prompt_len + 1)), max_new_tokens)
    replay.prefill(env, req, first_token=50_000)
    return req


def _decode_step(env, req, evict=True):
    """One decode step, evicting first (every step: the tightest cadence)."""
    if evict and req.decode_batch_idx >= 1:
        env.batch._evict_swa(req, req.seqlen - 1)  # what maybe_evict_swa calls
    replay.alloc_decode_slot(env, req)
    req.decode_batch_idx += 1
    req.kv_committed_len += 1
    replay.mamba_track_after_decode(env, req)
    req.output_ids.append(70_000 + req.decode_batch_idx)


def test_tree_checkpoint_is_the_rematched_mamba_node(long_env):
    """After cache_unfinished_req: the request field is cleared, last_node is
    the node holding the donated Mamba state, cache_protected_len is its depth
    (page aligned), and len(prefix_indices) is NOT that depth (it also covers
    the uncached prompt tail)."""
    req = _prefilled(long_env)
    mamba_type = ComponentType.MAMBA
    assert req.mamba_last_track_seqlen is None
    assert req.last_node is not long_env.cache.root_node
    assert req.last_node.component_data[mamba_type].value is not None
    assert req.cache_protected_len == _depth(req.last_node) == PREFILL_CKPT
    assert req.cache_protected_len % PAGE == 0
    assert len(req.prefix_indices) == LONG_PROMPT != req.cache_protected_len
    assert patch._tree_checkpoint(long_env.cache, req, mamba_type) == PREFILL_CKPT


def test_first_decode_step_after_prefill_sees_a_floor(long_env):
    req = _prefilled(long_env)
    expected = {"tree": PREFILL_CKPT - SWA_WINDOW, "old": None, "off": None}
    assert long_env.cache.swa_retain_floor(req) == expected[long_env.floor]
    # The first decode batch: maybe_evict_swa on a real ScheduleBatch.
    long_env.batch.reqs = [req]
    long_env.batch.forward_iter = 0  # an eviction step of SGLang's cadence
    req.decode_batch_idx = 1
    seen = []
    original = common.free_swa_out_of_window_slots.__wrapped__

    def spy(*args, **kwargs):
        seen.append(args[1])  # the pre_len the original receives
        return original(*args, **kwargs)

    patched = patch._wrap_free_swa_out_of_window_slots(spy)
    saved = common.free_swa_out_of_window_slots
    common.free_swa_out_of_window_slots = patched
    try:
        long_env.batch.maybe_evict_swa()
    finally:
        common.free_swa_out_of_window_slots = saved
        long_env.batch.reqs = []
    # With the tree checkpoint pre_len is lowered to floor + max(window, page):
    # the clamp is active from the first decode batch on.
    tail = LONG_PROMPT + 1 - 1  # req.seqlen - 1 (prompt + the prefill's token)
    assert seen == [PREFILL_CKPT if long_env.floor == "tree" else tail]
    assert req.kv.swa_evicted_seqlen == PREFILL_CKPT  # evict_floor = cache_protected_len
    release_kv_cache(req, long_env.cache)
    long_env.cache.sanity_check()


def _swa_live(env, req, start, end):
    full = env.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].to(torch.int64)
    return bool((env.allocator.full_to_swa_index_mapping[full] > 0).all())


@pytest.mark.parametrize("n_decode", [250, 520])  # finish before / after 1536
def test_prefill_checkpoint_window_survives_decode_eviction(long_env, n_decode):
    req = _prefilled(long_env)
    frontiers = []
    for _ in range(n_decode):
        _decode_step(long_env, req)
        frontiers.append(req.kv.swa_evicted_seqlen)
        # The window under the prefill checkpoint is tree-owned: never freed.
        assert _swa_live(long_env, req, PREFILL_CKPT - SWA_WINDOW, PREFILL_CKPT)
        floor = long_env.cache.swa_retain_floor(req)
        if long_env.floor == "tree":
            ckpt = req.mamba_last_track_seqlen or PREFILL_CKPT
            assert floor == max(ckpt, PREFILL_CKPT) - SWA_WINDOW
    # The first decode step does not evict (the prefill batch may still run);
    # from then on the frontier only moves forward, page by page, never below
    # the tree's part.
    assert frontiers[0] == 0
    frontiers = frontiers[1:]
    assert frontiers == sorted(frontiers)
    assert all(f % PAGE == 0 and f >= PREFILL_CKPT for f in frontiers)
    before_first_ckpt = frontiers[: FIRST_DECODE_CKPT - LONG_PROMPT - 2]
    if long_env.floor == "tree":
        # Nothing of the request's own is freed before its first decode checkpoint.
        assert set(before_first_ckpt) == {PREFILL_CKPT}
    else:
        # Tail-relative: pages go as soon as they leave the window.
        assert max(before_first_ckpt) == (1040 + min(n_decode, 495) - 1 - 128) // PAGE * PAGE
    if n_decode > FIRST_DECODE_CKPT - LONG_PROMPT:
        assert req.mamba_last_track_seqlen == FIRST_DECODE_CKPT
        if long_env.floor != "off":
            assert frontiers[-1] == FIRST_DECODE_CKPT - SWA_WINDOW
            assert _swa_live(long_env, req, FIRST_DECODE_CKPT - SWA_WINDOW, FIRST_DECODE_CKPT)

    release_kv_cache(req, long_env.cache)
    long_env.cache.sanity_check()
    ids = list(req.origin_input_ids) + list(req.output_ids) + [60_000 + i for i in range(64)]
    again = replay.new_req("r2", ids, 1)
    again.init_next_round_input(long_env.cache)
    matched = len(again.prefix_indices)
    assert matched >= PREFILL_CKPT  # prefill-region hit under every setting
    if n_decode > FIRST_DECODE_CKPT - LONG_PROMPT and long_env.floor != "off":
        assert matched == FIRST_DECODE_CKPT


def test_tree_floor_costs_at_most_interval_plus_chunk(long_env):
    """What the tree checkpoint keeps beyond the tail-relative window before the
    first decode checkpoint is bounded by the interval + one mamba chunk."""
    req = _prefilled(long_env)
    worst = 0
    for _ in range(FIRST_DECODE_CKPT - LONG_PROMPT + 40):
        _decode_step(long_env, req)
        live = req.kv_committed_len - max(req.kv.swa_evicted_seqlen, req.cache_protected_len)
        worst = max(worst, live)
    chunk = max(replay.FLA_CHUNK_SIZE, PAGE)
    assert worst <= LONG_INTERVAL + chunk
    if long_env.floor == "tree":
        assert worst == FIRST_DECODE_CKPT - PREFILL_CKPT
    release_kv_cache(req, long_env.cache)


def test_second_round_admission_uses_the_matched_checkpoint(long_env):
    """A request admitted on a cached prefix (no prefill track: extend shorter
    than a chunk) keeps the matched Mamba node as its tree checkpoint."""
    first = _prefilled(long_env, rid="a", max_new_tokens=1)
    release_kv_cache(first, long_env.cache)
    # Same prompt plus 40 tokens: matches 1024, extends 56 < chunk 128.
    req = replay.new_req("b", list(range(1, LONG_PROMPT + 41)), 10)
    replay.prefill(long_env, req, first_token=50_000)
    assert req.cache_protected_len == PREFILL_CKPT
    assert req.mamba_last_track_seqlen is None
    expected = {"tree": PREFILL_CKPT - SWA_WINDOW, "old": None, "off": None}
    assert long_env.cache.swa_retain_floor(req) == expected[long_env.floor]
    release_kv_cache(req, long_env.cache)
    long_env.cache.sanity_check()


def test_request_checkpoint_behind_the_tree_one_is_overridden():
    from sglang_session_cache.retain_floor import retain_floor_from_checkpoints

    assert retain_floor_from_checkpoints(None, None, 128) is None
    assert retain_floor_from_checkpoints(512, None, 128) == 384
    assert retain_floor_from_checkpoints(None, 1024, 128) == 896
    assert retain_floor_from_checkpoints(768, 1024, 128) == 896
    assert retain_floor_from_checkpoints(1536, 1024, 128) == 1408
    assert retain_floor_from_checkpoints(None, 64, 128) == 0


def test_no_tree_floor_without_the_extra_buffer():
    """No-buffer Mamba (page 1): the finish insert ends at the live tail, which
    tail-relative eviction keeps; a tree floor would never be overtaken there.
    The floor stays None and decode eviction is SGLang's, slot for slot."""
    runs = []
    for _ in range(2):
        h = make_swa_mamba_cache(sliding_window_size=WINDOW, enable_session=True)
        req = h.new_req(list(range(1, 41)))
        h.prefill(req)
        assert req.last_node.component_data[ComponentType.MAMBA].value is not None
        assert req.cache_protected_len == 40
        assert h.cache.swa_retain_floor(req) is None
        runs.append((h, req))
    (h0, r0), (h1, r1) = runs
    for _ in range(30):
        for h, r, fn, kw in ((h0, r0, ORIGINAL, {}), (h1, r1, PATCHED, {"retain_floor": h1.cache.swa_retain_floor(r1)})):
            h.decode(r, 1)
            fn(
                r, r.seqlen - 1, sliding_window_size=WINDOW, page_size=1,
                req_to_token_pool=h.req_to_token_pool, token_to_kv_pool_allocator=h.allocator, **kw,
            )
        assert_same_state(state(h0, r0), state(h1, r1))
    assert r1.kv.swa_evicted_seqlen > 40
    for h, r in runs:
        h.finish(r)
        h.check()


@pytest.mark.parametrize(
    "make", [make_swa_cache, make_full_mamba_cache, make_full_cache], ids=["swa", "full_mamba", "full"]
)
def test_prefilled_requests_on_non_swa_mamba_caches_have_no_floor(make):
    h = make()
    req = h.new_req(list(range(1, 41)))
    h.prefill(req)
    assert h.cache.swa_retain_floor(req) is None
    h.decode(req, 3)
    assert h.cache.swa_retain_floor(req) is None
    h.finish(req)
    h.check()
