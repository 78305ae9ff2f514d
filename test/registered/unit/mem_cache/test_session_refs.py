"""Session references on the real UnifiedRadixCache: lifecycle, per-component
accounting, splits and eviction fallbacks, for FULL, FULL+SWA and
FULL+SWA+Mamba caches built from real pools and allocators on CPU."""

import logging
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, arrive  # noqa: E402
from cache_fixtures import make_full_cache  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache.component_refs import SessionStateError  # noqa: E402
from sglang_session_cache.session_tracker import (  # noqa: E402
    CLOSED_SESSION_TOMBSTONE_LIMIT,
    SessionRefError,
)

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

SYSTEM = list(range(1000, 1040))  # 40-token shared system prompt


@pytest.fixture(params=list(SHAPES))
def h(request):
    harness = SHAPES[request.param]()
    yield harness
    harness.cache.validate_session_state()


def tracker(h):
    return h.cache.session_ref_tracker


def refs_by_node(h, ct):
    """{node_id: {sid: number of sid's leaves covering it}}, from the leaf
    index (nodes store counts only)."""
    return {n.id: per for n, per in tracker(h).components[ct].coverage().items()}


def sessions_at(h, node, ct):
    return refs_by_node(h, ct).get(node.id, {})


def path_to_root(h, node):
    out = []
    while node is not h.cache.root_node:
        out.append(node)
        node = node.parent
    return out


def only_leaf(h, sid, ct=FULL):
    leaves = tracker(h).session_leaves(sid, ct)
    assert len(leaves) == 1, leaves
    return next(iter(leaves))


def referenced_total(h):
    return sum(
        n.component_data[ct].session_ref
        for n in h.tree_nodes()
        for ct in h.cache.tree_components
    )


# ---- ownership --------------------------------------------------------------


def test_only_unified_radix_cache_owns_a_tracker():
    on = make_full_cache(enable_session=True)
    off = make_full_cache(enable_session=False)
    assert on.cache.session_ref_tracker is not None
    assert off.cache.session_ref_tracker is None
    # Flag off: the new API is inert and eviction uses SGLang's own classes.
    assert off.cache.release_radix_session("x") == 0
    assert off.cache.open_radix_session("x") is None
    assert type(off.cache.components[FULL]).__name__ == "FullComponent"
    assert type(on.cache.components[FULL]).__name__ == "SessionAwareFullComponent"
    # The base prefix cache keeps its no-op and has no tracker.
    assert BasePrefixCache.release_radix_session(None, "x") is None
    assert not hasattr(BasePrefixCache, "session_ref_tracker")


def test_legacy_radix_cache_no_longer_runs_session_mixin():
    import torch

    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    kv = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float16, head_num=1,
                          head_dim=2, layer_num=1, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=64, dtype=torch.float16, device="cpu",
                                   kvcache=kv, need_sort=False)
    r2t = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t,
                                       token_to_kv_pool_allocator=alloc, page_size=1,
                                       enable_session_radix_cache=True))
    assert cache.enable_session_radix_cache is False
    assert getattr(cache, "session_ref_tracker", None) is None
    cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=alloc.alloc(3)))
    before = cache.total_size()
    assert cache.release_radix_session("s") == 0  # old mixin would free nodes
    assert cache.total_size() == before


# ---- per-component accounting ------------------------------------------------


def test_register_counts_per_component(h):
    req = h.run_request(SYSTEM + list(range(1, 13)), session_id="s", n_decode=6)
    assert tracker(h).counters.registered == 1
    leaf = only_leaf(h, "s")
    # The leaf is the node the insert ended on: its path spells the request's
    # cached tokens.
    path = path_to_root(h, leaf)
    cached = sum(len(n.key) for n in path)
    assert 0 < cached <= len(req.origin_input_ids) + len(req.output_ids)

    full = refs_by_node(h, FULL)
    assert set(full) == {n.id for n in path}
    assert all(v == {"s": 1} for v in full.values())

    if h.has_swa:
        swa = refs_by_node(h, SWA)
        window = h.sliding_window_size + h.page_size
        acc, expect = 0, set()
        for n in path:
            if acc >= window:
                break
            expect.add(n.id)
            acc += len(n.key)
        assert set(swa) == expect
        assert set(swa) <= set(full)
    if h.has_mamba:
        assert refs_by_node(h, MAMBA) == {leaf.id: {"s": 1}}
        assert leaf.component_data[MAMBA].value is not None
    h.cache.validate_session_state()


def test_shared_prefix_counts_distinct_sessions(h):
    h.run_request(SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8], session_id="a", n_decode=2)
    h.run_request(SYSTEM + [9, 9, 9, 9, 9, 9, 9, 9], session_id="b", n_decode=2)
    h.cache.validate_session_state()
    a_path = {n.id for n in path_to_root(h, only_leaf(h, "a"))}
    b_path = {n.id for n in path_to_root(h, only_leaf(h, "b"))}
    shared = a_path & b_path
    assert shared, "the system prompt node must be shared"
    for n in h.tree_nodes():
        if n.id in shared:
            assert n.component_data[FULL].session_ref == 2
            assert n.full_session_ref == 2

    assert h.cache.release_radix_session("a") == len(h.cache.tree_components)
    h.cache.validate_session_state()
    for n in h.tree_nodes():
        if n.id in shared:
            assert sessions_at(h, n, FULL) == {"b": 1}
            assert n.component_data[FULL].session_ref == 1
        if n.id in a_path - shared:
            assert n.component_data[FULL].session_ref == 0
    h.cache.release_radix_session("b")
    h.cache.validate_session_state()
    assert referenced_total(h) == 0
    # Close drops references only: the KV is still reusable.
    assert h.match_len(SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]) >= len(SYSTEM)
    h.check()


def test_newer_turn_only_adds_the_delta(h):
    turn1 = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]
    r1 = h.run_request(turn1, session_id="s", n_decode=4)
    leaf1 = only_leaf(h, "s")
    before = refs_by_node(h, FULL)
    turn2 = list(r1.origin_input_ids) + list(r1.output_ids) + [21, 22, 23, 24, 25]
    h.run_request(turn2, session_id="s", n_decode=4)
    leaf2 = only_leaf(h, "s")
    assert leaf2 is not leaf1
    after = refs_by_node(h, FULL)
    # Every node keeps multiplicity 1 (never double counted) and the old path
    # keeps its reference.
    assert all(v == {"s": 1} for v in after.values())
    assert set(before) <= set(after)
    if h.has_mamba:
        # Mamba references the newest state only.
        assert refs_by_node(h, MAMBA) == {leaf2.id: {"s": 1}}
    h.cache.validate_session_state()


def test_swa_overlapping_windows_of_one_session():
    h = SHAPES["swa"](sliding_window_size=16, num_tokens=512)
    base = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]
    # Two branches of one session whose windows overlap on the common tail.
    h.run_request(base + [50, 51, 52, 53], session_id="s")
    h.run_request(base + [60, 61, 62, 63], session_id="s")
    assert len(tracker(h).session_leaves("s", SWA)) == 2
    swa = refs_by_node(h, SWA)
    assert all(set(v) == {"s"} for v in swa.values())
    shared = [n for n in h.tree_nodes() if sessions_at(h, n, SWA).get("s") == 2]
    assert shared, "the common tail is covered by both windows"
    # SWA counts leaf references (eviction only asks "any?"): two here.
    assert all(n.component_data[SWA].session_ref == 2 for n in shared)
    h.cache.validate_session_state()


def test_split_keeps_counts_correct(h):
    tokens = SYSTEM + list(range(1, 25))
    h.run_request(tokens, session_id="s")
    nodes_before = len(h.tree_nodes())
    # A request diverging inside the referenced leaf splits it.
    h.run_request(SYSTEM + list(range(1, 9)) + [77] * 8)
    assert len(h.tree_nodes()) > nodes_before
    h.cache.validate_session_state()
    leaf = only_leaf(h, "s")
    for n in path_to_root(h, leaf):
        assert sessions_at(h, n, FULL) == {"s": 1}
        assert n.component_data[FULL].session_ref == 1
    # A match that ends mid-node also splits; counts still hold.
    h.match_len(SYSTEM + list(range(1, 5)))
    h.cache.validate_session_state()


def test_evicting_referenced_leaf_moves_ref_to_ancestor(h):
    h.run_request(SYSTEM + [1, 2, 3, 4], session_id="s")
    h.run_request(SYSTEM + [1, 2, 3, 4] + [5, 6, 7, 8, 9, 10, 11, 12], session_id="s2")
    leaf = only_leaf(h, "s2")
    parent = leaf.parent
    # Nothing unreferenced is left: soft protection still evicts.
    h.evict(num_tokens=len(leaf.key))
    assert leaf.parent is None or leaf not in parent.children.values()
    h.cache.validate_session_state()
    moved = tracker(h).session_leaves("s2", FULL)
    assert moved and all(m is not leaf for m in moved)
    new_leaf = next(iter(moved))
    assert new_leaf in path_to_root(h, parent) or new_leaf is parent


def test_evict_everything_then_close_leaks_nothing(h):
    for i, sid in enumerate(["a", "b", "c"]):
        h.run_request(SYSTEM + [i] * 12, session_id=sid, n_decode=3)
    h.evict_all()
    h.cache.validate_session_state()
    for sid in ["a", "b", "c"]:
        h.cache.release_radix_session(sid)
    h.cache.validate_session_state()
    assert referenced_total(h) == 0
    assert not any(refs.leaves for refs in tracker(h).components.values())
    h.check()


# ---- lifecycle rules -------------------------------------------------------------


def test_stale_generation_is_rejected_after_close_and_reopen(h, caplog):
    t = tracker(h)
    req = h.new_req(SYSTEM + [1, 2, 3, 4], session_id="s")
    gen1 = h.cache.ensure_session_generation(req)
    h.prefill(req, finishing=True)
    h.cache.release_radix_session("s")
    gen2 = h.cache.open_radix_session("s")
    assert gen2 != gen1
    with caplog.at_level(logging.WARNING):
        h.finish(req)
    assert t.counters.stale_rejected == 1
    assert "generation" in caplog.text
    assert not t.session_leaves("s")
    assert referenced_total(h) == 0
    # KV was still cached normally.
    assert h.match_len(SYSTEM + [1, 2, 3, 4]) > 0
    # A request of the new generation registers.
    h.run_request(SYSTEM + [1, 2, 3, 4, 5], session_id="s")
    assert t.session_leaves("s")


def test_request_finishing_after_close_registers_nothing(h):
    t = tracker(h)
    req = h.new_req(SYSTEM + [7, 7, 7, 7], session_id="late")
    h.cache.ensure_session_generation(req)
    h.prefill(req)
    h.decode(req, 3)
    h.cache.release_radix_session("late")
    h.finish(req)
    assert t.counters.late_finish_skipped == 1
    assert referenced_total(h) == 0
    assert "late" not in t.open_sessions()
    h.check()


def test_close_is_idempotent_and_unknown_close_is_harmless(h, caplog):
    h.run_request(SYSTEM + [1, 2, 3], session_id="s")
    assert h.cache.release_radix_session("s") > 0
    assert h.cache.release_radix_session("s") == 0
    with caplog.at_level(logging.DEBUG, logger="sglang.srt.mem_cache.unified_radix_cache"):
        assert h.cache.release_radix_session("never-opened") == 0
    assert "unknown session" in caplog.text
    # Closes fanned out to DP ranks / workers that never saw the id stay quiet.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Close before open: a late finish for that id registers nothing either.
    req = h.new_req(SYSTEM + [4, 4], session_id="never-opened")
    req.session_ref_generation = 1
    h.prefill(req, finishing=True)
    h.finish(req)
    assert referenced_total(h) == 0


@pytest.mark.parametrize("bad", ["", "   ", None, 42, "x" * 100_000, "a\x00b", "a\nb"])
def test_bad_session_ids_get_a_clear_error_and_change_nothing(bad):
    h = SHAPES["full"]()
    h.run_request(SYSTEM + [1, 2], session_id="keep")
    snapshot = refs_by_node(h, FULL)
    with pytest.raises(SessionRefError, match="session_id must be a non-empty string"):
        h.cache.release_radix_session(bad)
    with pytest.raises(SessionRefError):
        h.cache.open_radix_session(bad)
    assert refs_by_node(h, FULL) == snapshot
    assert tracker(h).open_sessions() == ["keep"]


def test_streaming_and_aborted_requests_are_skipped():
    h = SHAPES["full"]()
    t = tracker(h)
    h.cache.open_radix_session("stream", streaming=True)
    h.run_request(SYSTEM + [1], session_id="stream")
    assert not t.session_leaves("stream")
    req = h.new_req(SYSTEM + [2], session_id="ab")
    h.prefill(req, finishing=True)
    req.finished_reason = FINISH_ABORT("client went away")
    h.finish(req)
    assert not t.session_leaves("ab")
    assert referenced_total(h) == 0


def test_tombstones_are_bounded():
    h = SHAPES["full"]()
    t = tracker(h)
    t.tombstone_limit = 16
    for i in range(40):
        h.cache.open_radix_session(f"s{i}")
        h.cache.release_radix_session(f"s{i}")
    assert len(t.closed) == 16
    assert list(t.closed)[0] == "s24"  # oldest dropped first
    assert CLOSED_SESSION_TOMBSTONE_LIMIT == 8192


def test_root_is_never_registered(h):
    req = h.new_req([5], session_id="tiny")
    assert tracker(h).register_session_ref(req, h.cache.root_node) is False
    assert not tracker(h).session_leaves("tiny")


def test_validator_fails_loudly_on_a_leak(h):
    h.run_request(SYSTEM + [1, 2, 3], session_id="s")
    node = only_leaf(h, "s")
    node.component_data[FULL].session_ref += 1
    with pytest.raises(SessionStateError, match="leaf index implies"):
        h.cache.validate_session_state()
    node.component_data[FULL].session_ref -= 1
    h.cache.validate_session_state()


# ---- randomized stress ------------------------------------------------------------


@pytest.mark.parametrize("shape,ops", [("full", 2500), ("swa", 2000), ("swa_mamba", 1200)])
def test_randomized_stress_never_leaks(shape, ops):
    rng = random.Random(1234 + len(shape))
    kw = {"num_tokens": 1024}
    if shape != "full":
        kw["sliding_window_size"] = 8
    if shape == "swa_mamba":
        kw["mamba_num_slots"] = 24
    h = SHAPES[shape](**kw)
    t = tracker(h)
    sessions = [f"s{i}" for i in range(24)]
    history = {}
    in_flight = []  # requests admitted but not finished (they hold locks)
    for step in range(ops):
        op = rng.random()
        sid = rng.choice(sessions)
        if op < 0.50:
            prev = history.get(sid)
            if prev is not None and rng.random() < 0.8:
                tokens = prev + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            else:
                tokens = SYSTEM[: rng.choice([0, 16, 40])] + [
                    rng.randrange(50) for _ in range(rng.randint(2, 14))
                ]
            req = arrive(h, tokens, sid if rng.random() < 0.85 else None)
            h.prefill(req)
            if len(in_flight) < 3 and rng.random() < 0.3:
                in_flight.append(req)  # finishes later, maybe after a close
                continue
            h.decode(req, rng.randint(0, 4))
            h.finish(req)
            history[sid] = list(req.origin_input_ids) + list(req.output_ids)
            if len(history[sid]) > 200:
                history.pop(sid)
        elif op < 0.58 and in_flight:
            req = in_flight.pop(rng.randrange(len(in_flight)))
            h.decode(req, rng.randint(0, 3))
            h.finish(req)
        elif op < 0.70:
            h.cache.release_radix_session(sid)
        elif op < 0.76:
            h.cache.open_radix_session(sid)
        elif op < 0.90:
            h.evict(num_tokens=rng.randint(1, 64),
                    swa_num_tokens=rng.randint(1, 32) if h.has_swa else 0,
                    mamba_num=rng.randint(1, 3) if h.has_mamba else 0)
        else:
            h.match_len(history.get(sid, SYSTEM)[: rng.randint(1, 60)])
        h.cache.validate_session_state()
    for req in in_flight:
        h.finish(req)
    c = t.counters
    assert c.registered > ops // 5
    assert c.late_finish_skipped + c.stale_rejected > 0
    for sid in sessions:
        h.cache.release_radix_session(sid)
    h.cache.validate_session_state()
    assert referenced_total(h) == 0
    assert not any(refs.leaves for refs in t.components.values())
    h.check()
