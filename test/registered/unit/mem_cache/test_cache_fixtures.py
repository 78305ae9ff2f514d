"""Drives real SGLang ``Req`` objects through a real ``UnifiedRadixCache`` on
CPU (see cache_fixtures.py) for every cache shape: prefix reuse, eviction,
eviction under memory pressure, in-flight requests, SWA tombstones, Mamba
copy-on-write, and the harness's own leak detector. Stock behaviour only
(``enable_session=False``)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # pytest's rootdir-based import usually adds it already
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402
import torch  # noqa: E402

from cache_fixtures import (  # noqa: E402
    CacheHarness,
    make_full_cache,
    make_full_mamba_cache,
    make_swa_cache,
    make_swa_mamba_cache,
    release_server_args,
)
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402

SHAPES = {
    "full_p1": lambda **kw: make_full_cache(page_size=1, **kw),
    "full_p4": lambda **kw: make_full_cache(page_size=4, **kw),
    "swa_p1": lambda **kw: make_swa_cache(page_size=1, **kw),
    "swa_p4": lambda **kw: make_swa_cache(page_size=4, **kw),
    "full_mamba": lambda **kw: make_full_mamba_cache(**kw),
    "swa_mamba": lambda **kw: make_swa_mamba_cache(**kw),
}


@pytest.fixture(scope="module", autouse=True)
def _server_args():
    yield
    release_server_args()


def tokens(seed: int, n: int) -> list[int]:
    """``n`` prompt tokens, distinct across seeds (all below 1_000_000)."""
    return [seed * 1000 + i for i in range(1, n + 1)]


def floor_page(n: int, h: CacheHarness) -> int:
    return n // h.page_size * h.page_size


def totals(h: CacheHarness) -> dict:
    out = {"full": h.full_allocator.size}
    if h.has_swa:
        out["swa"] = h.swa_allocator.size
    if h.mamba_allocator is not None:
        out["mamba"] = h.mamba_allocator.size
    return out


def assert_all_free(h: CacheHarness) -> None:
    avail = h.available()
    for pool, total in totals(h).items():
        assert avail[pool] == total, (pool, avail)


@pytest.mark.parametrize("shape", SHAPES)
def test_prefix_reuse(shape):
    h = SHAPES[shape]()
    system = tokens(1, 40)

    r1 = h.run_request(system + tokens(2, 6), n_decode=5)
    assert r1.matched_prefix_len == 0
    assert r1.req_pool_idx is None and r1.kv is None
    h.check()

    # Next turn of the same conversation: prompt + everything r1 generated
    # (its last sampled token has no KV) + a new user message.
    turn2 = list(r1.origin_input_ids) + list(r1.output_ids) + tokens(3, 5)
    r2 = h.run_request(turn2, n_decode=3)
    assert r2.matched_prefix_len == floor_page(r1.kv_committed_len, h) > 0
    assert r2.cached_tokens == r2.matched_prefix_len
    h.check()

    # Branch off the shared system prompt.
    r3 = h.run_request(system + tokens(4, 7), n_decode=2)
    if h.has_mamba:
        # Mamba states live only where a request ended a prefill or finished,
        # so a branch point inside a cached span has no reusable state.
        assert r3.matched_prefix_len == 0
        # r1's full prompt ends on a node holding a state (cache_unfinished_req).
        r4 = h.run_request(list(r1.origin_input_ids) + tokens(5, 3))
        assert r4.matched_prefix_len == len(r1.origin_input_ids)
    else:
        assert r3.matched_prefix_len == floor_page(len(system), h)
    h.check()


@pytest.mark.parametrize("shape", SHAPES)
def test_evict_frees_tokens(shape):
    h = SHAPES[shape]()
    for seed in range(3):
        h.run_request(tokens(seed, 24), n_decode=4)
    h.check()
    before = h.available()
    assert before["full"] < h.full_allocator.size
    assert before["full_evictable"] > 0 and before["full_protected"] == 0

    res = h.evict(num_tokens=8)
    assert res.num_tokens_evicted >= 8
    after = h.available()
    assert after["full"] - before["full"] == res.num_tokens_evicted
    assert before["full_evictable"] - after["full_evictable"] == res.num_tokens_evicted
    h.check()

    res = h.evict_all()
    assert res.num_tokens_evicted == after["full_evictable"]
    if h.has_swa:
        assert res.swa_num_tokens_evicted > 0
    if h.has_mamba:
        assert res.mamba_num_evicted > 0
    h.check()
    assert_all_free(h)
    assert [n is h.cache.root_node for n in h.tree_nodes()] == [True]


def run_pressure(h: CacheHarness, n_requests: int = 10) -> None:
    reqs = []
    for seed in range(n_requests):
        reqs.append(h.run_request(tokens(seed, 36), n_decode=6))
        h.check()
    # The newest conversation is still cached and reusable ...
    last = reqs[-1]
    follow_up = list(last.origin_input_ids) + list(last.output_ids) + tokens(99, 2)
    assert h.run_request(follow_up).matched_prefix_len == floor_page(
        last.kv_committed_len, h
    )
    # ... while the oldest had to be evicted to admit the later ones.
    first = list(reqs[0].origin_input_ids)
    assert h.match_len(first + tokens(98, 2)) == 0
    assert h.run_request(first + tokens(98, 2)).matched_prefix_len == 0
    h.check()
    h.evict_all()
    h.check()
    assert_all_free(h)


@pytest.mark.parametrize("shape", SHAPES)
def test_eviction_under_memory_pressure(shape):
    # Each request needs ~half the KV pool, so every admission has to evict
    # earlier conversations through the real alloc paths.
    kw = dict(num_tokens=96)
    if shape.startswith("swa"):
        kw["swa_num_tokens"] = 72
    if "mamba" in shape:
        kw["mamba_num_slots"] = 5
    run_pressure(SHAPES[shape](**kw))


@pytest.mark.parametrize("shape", ["full_p1", "full_p4", "swa_p4"])
def test_eviction_with_sorted_free_lists(shape):
    # need_sort=True parks frees in release_pages until an alloc merges them.
    kw = dict(num_tokens=96, need_sort=True)
    if shape.startswith("swa"):
        kw["swa_num_tokens"] = 72
    run_pressure(SHAPES[shape](**kw))


@pytest.mark.parametrize("shape", SHAPES)
def test_inflight_requests(shape):
    h = SHAPES[shape]()
    prompt_a = tokens(1, 30)
    a = h.new_req(prompt_a)
    assert h.prefill(a) == 0
    h.decode(a, 3)
    h.check()  # conservation counts a's own KV

    # b arrives while a is running and reuses a's prompt, which a inserted
    # with cache_unfinished_req after its prefill.
    b = h.new_req(prompt_a + tokens(2, 10))
    assert h.prefill(b) == floor_page(len(prompt_a), h)
    h.decode(b, 2)
    h.decode(a, 2)
    h.check()
    avail = h.available()
    assert avail["full_protected"] > 0
    assert avail["req_slots"] == h.req_to_token_pool.size - 2

    # Locked prefixes survive an "evict everything".
    h.evict_all()
    h.check()
    assert h.available()["full_protected"] == avail["full_protected"]

    h.finish(a)
    h.check()
    h.finish(b)
    h.check()
    assert h.available()["full_protected"] == 0
    h.evict_all()
    h.check()
    assert_all_free(h)


@pytest.mark.parametrize("shape", SHAPES)
def test_failed_admission_rolls_back(shape):
    kw = dict(num_tokens=48)
    if shape.startswith("swa"):
        kw["swa_num_tokens"] = 48
    h = SHAPES[shape](**kw)
    h.run_request(tokens(1, 20), n_decode=2)
    with pytest.raises(RuntimeError, match="(?i)out of memory"):
        h.run_request(tokens(2, 80))
    assert not h.live_reqs
    h.check()
    # Nothing leaked: the pool still serves a request that fits.
    h.run_request(tokens(3, 30), n_decode=2)
    h.check()


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_prefill(shape):
    h = SHAPES[shape]()
    prompt = tokens(1, 50)
    r1 = h.new_req(prompt)
    assert h.prefill(r1, chunk_size=16) == 0
    assert r1.inflight_middle_chunks == 0 and r1.kv_committed_len == 50
    h.check()
    h.decode(r1, 2)
    h.finish(r1)
    h.check()
    # Middle chunks were stashed with cache_unfinished_req(chunked=True), which
    # for Mamba also leaves a state at each chunk boundary (16, 32).
    r2 = h.run_request(prompt[:40] + tokens(2, 3))
    assert r2.matched_prefix_len == (32 if h.has_mamba else 40)
    r3 = h.run_request(prompt + tokens(3, 20), chunk_size=8)
    assert r3.matched_prefix_len == floor_page(50, h)
    h.check()
    h.evict_all()
    h.check()
    assert_all_free(h)


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_tombstones(page_size):
    h = make_swa_cache(page_size=page_size, sliding_window_size=8)
    prompt = tokens(1, 16)
    r1 = h.run_request(prompt, n_decode=40)
    h.check()

    def tombstones():
        return [
            n
            for n in h.tree_nodes()
            if n is not h.cache.root_node
            and n.component_data[ComponentType.FULL].value is not None
            and n.component_data[ComponentType.SWA].value is None
        ]

    # Decode-time out-of-window SWA frees leave FULL-only nodes behind.
    assert tombstones()
    assert h.available()["swa"] > h.available()["full"]

    # The whole conversation is reusable (window intact at its end) ...
    seq = list(r1.origin_input_ids) + list(r1.output_ids)
    r2 = h.run_request(seq + tokens(2, 3))
    assert r2.matched_prefix_len == floor_page(r1.kv_committed_len, h)
    # ... but a match ending inside the tombstoned span falls back to the
    # prompt, the deepest point with a full sliding window of SWA KV.
    r3 = h.run_request(seq[:36] + tokens(3, 3))
    assert r3.matched_prefix_len == len(prompt)
    h.check()

    # SWA-only eviction tombstones more nodes without touching FULL KV.
    full_before = h.available()["full"]
    n_tomb = len(tombstones())
    res = h.evict(swa_num_tokens=8)
    assert res.swa_num_tokens_evicted >= 8
    assert h.available()["full"] - full_before == res.num_tokens_evicted
    assert len(tombstones()) >= n_tomb
    h.check()
    h.evict_all()
    h.check()
    assert_all_free(h)


@pytest.mark.parametrize("shape", ["full_mamba", "swa_mamba"])
def test_mamba_copy_on_write(shape):
    h = SHAPES[shape]()
    pool = h.req_to_token_pool.mamba_pool
    r1 = h.new_req(tokens(1, 20))
    h.prefill(r1)
    # Stand in for the forward: give r1's running state a recognizable value.
    slot1 = int(r1.mamba_pool_idx)
    pool.mamba_cache.temporal[:, slot1] = 7.0
    h.decode(r1, 3)
    h.finish(r1)
    h.check()
    leaf_states = [
        int(n.component_data[ComponentType.MAMBA].value)
        for n in h.tree_nodes()
        if n.component_data[ComponentType.MAMBA].value is not None
    ]
    assert slot1 in leaf_states  # finished state donated to the tree

    follow_up = list(r1.origin_input_ids) + list(r1.output_ids) + tokens(2, 4)
    r2 = h.new_req(follow_up)
    assert h.prefill(r2) == r1.kv_committed_len
    slot2 = int(r2.mamba_pool_idx)
    assert slot2 != slot1
    assert torch.all(pool.mamba_cache.temporal[:, slot2] == 7.0)
    h.finish(r2)
    h.check()


def test_full_cache_lru_order():
    h = make_full_cache(num_tokens=128)
    old = h.run_request(tokens(1, 20))
    new = h.run_request(tokens(2, 20))
    h.evict(num_tokens=20)
    assert h.run_request(list(new.origin_input_ids) + [7]).matched_prefix_len == 20
    assert h.run_request(list(old.origin_input_ids) + [7]).matched_prefix_len == 0
    h.check()


def test_planned_outputs_and_extra_key():
    h = make_full_cache()
    req = h.new_req(tokens(1, 10), output_ids=[7, 8, 9], extra_key="tenant-a")
    h.prefill(req)
    h.decode(req, 3)
    assert list(req.output_ids[:3]) == [7, 8, 9] and req.output_ids[3] >= 1_000_000
    h.finish(req)
    history = list(req.origin_input_ids) + list(req.output_ids)
    assert h.match_len(history, extra_key="tenant-a") == req.kv_committed_len
    # extra_key namespaces the radix tree: another tenant shares nothing.
    other = h.new_req(history + [1], extra_key="tenant-b")
    assert h.prefill(other, finishing=True) == 0
    h.finish(other)
    h.check()


def test_check_detects_leaks_and_stray_locks():
    h = make_full_cache(num_tokens=64)
    h.run_request(tokens(1, 10))
    h.check()
    leaked = h.allocator.alloc(3)
    with pytest.raises(AssertionError, match="leaked"):
        h.check()
    h.allocator.free(leaked)
    h.check()

    leaf = next(n for n in h.tree_nodes() if n is not h.cache.root_node)
    h.cache.inc_lock_ref(leaf)
    with pytest.raises(AssertionError, match="idle"):
        h.check()
    h.cache.dec_lock_ref(leaf)
    h.check()


def test_mamba_requires_page_size_one():
    with pytest.raises(ValueError, match="page_size=1"):
        make_swa_mamba_cache(page_size=4)


@pytest.mark.parametrize("shape", SHAPES)
def test_random_interleaving_keeps_invariants(shape):
    """Seeded random mix of admissions (plain and chunked), decode steps,
    finishes and explicit evictions with up to three requests in flight on a
    tight pool; sanity_check + slot conservation after every step."""
    import random

    rng = random.Random(1234)
    kw = dict(num_tokens=160)
    if shape.startswith("swa"):
        kw["swa_num_tokens"] = 100
    if "mamba" in shape:
        kw["mamba_num_slots"] = 10
    h = SHAPES[shape](**kw)
    conversations = [tokens(seed, rng.randint(5, 25)) for seed in range(4)]
    live = []
    n_ooms = 0
    for step in range(100):
        roll = rng.random()
        if roll < 0.3 and len(live) < 3:
            conv = rng.randrange(len(conversations))
            req = h.new_req(conversations[conv] + tokens(100 + step, rng.randint(1, 6)))
            try:
                h.prefill(req, chunk_size=rng.choice([None, 8]))
                live.append((conv, req))
            except RuntimeError:
                n_ooms += 1
        elif roll < 0.7 and live:
            _, req = rng.choice(live)
            try:
                h.decode(req, rng.randint(1, 5))
            except RuntimeError:
                n_ooms += 1
        elif live:
            conv, req = live.pop(rng.randrange(len(live)))
            h.finish(req)
            history = list(req.origin_input_ids) + list(req.output_ids)
            conversations[conv] = history if len(history) <= 70 else history[:10]
        else:
            h.evict(
                num_tokens=rng.randint(0, 20),
                swa_num_tokens=rng.randint(0, 20),
                mamba_num=rng.randint(0, 2),
            )
        h.check()
    for _, req in live:
        h.finish(req)
    h.check()
    h.evict_all()
    h.check()
    assert_all_free(h)
