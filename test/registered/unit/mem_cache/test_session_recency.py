"""Recency-preserving partition moves: closing a session returns its nodes to
the unreferenced partition where their recency puts them, so after every
session closes the LRU order equals a plain LRU of the same history."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import make_swa_mamba_cache, make_swa_cache  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402

SWA, MAMBA = ComponentType.SWA, ComponentType.MAMBA


def token_path(h, node):
    parts = []
    while node is not h.cache.root_node:
        parts.append(tuple(node.key.token_ids))
        node = node.parent
    return tuple(reversed(parts))


def lru_order(h, ct):
    """Token paths from LRU (evicted first) to MRU, sentinels skipped."""
    lru = h.cache.lru_lists[ct]
    out, x = [], lru.tail.lru_prev[lru._pt]
    while x is not lru.head:
        if x.id in lru.cache:
            out.append(token_path(h, x))
        x = x.lru_prev[lru._pt]
    return out


def replay(h, seed, sessions):
    """Multi-turn traffic with lookups, no eviction (pools are large)."""
    rng = random.Random(seed)
    history = {}
    for step in range(80):
        sid = rng.choice(sessions)
        prev = history.get(sid)
        if prev and rng.random() < 0.7:
            tokens = prev + [rng.randrange(40) for _ in range(rng.randint(1, 6))]
        else:
            tokens = [7] * rng.choice([0, 4, 8]) + [rng.randrange(40) for _ in range(6)]
        use = sid if (sessions and rng.random() < 0.7) else None
        req = h.run_request(tokens, session_id=use, n_decode=rng.randint(0, 3),
                            output_ids=[500 + step * 4 + i for i in range(4)])
        history[sid] = list(req.origin_input_ids) + list(req.output_ids)
        if rng.random() < 0.3:
            h.match_len(history[rng.choice(list(history))][: rng.randint(1, 30)])
        if step % 20 == 19 and sessions:
            # Close one mid-run: its nodes go back at their recency.
            h.cache.release_radix_session(rng.choice(sessions))
    assert h.evict(num_tokens=0).num_tokens_evicted == 0


@pytest.mark.parametrize("make", [make_swa_cache, make_swa_mamba_cache])
def test_order_after_close_matches_plain_lru(make):
    sessions = [f"s{i}" for i in range(6)]
    plain = make(enable_session=False, num_tokens=4096, mamba_num_slots=200) if (
        make is make_swa_mamba_cache) else make(enable_session=False, num_tokens=4096)
    ours = make(enable_session=True, num_tokens=4096, mamba_num_slots=200) if (
        make is make_swa_mamba_cache) else make(enable_session=True, num_tokens=4096)
    replay(plain, 11, sessions)
    replay(ours, 11, sessions)
    ours.cache.validate_session_state()
    assert any(n.component_data[SWA].session_ref for n in ours.tree_nodes()), \
        "some sessions must still be open before the final close"
    for sid in sessions:
        ours.cache.release_radix_session(sid)
    ours.cache.validate_session_state()
    cts = [SWA] + ([MAMBA] if plain.has_mamba else [])
    for ct in cts:
        assert lru_order(ours, ct) == lru_order(plain, ct), f"{ct} order differs"


def test_closed_cold_session_is_not_kept_ahead_of_warm_kv():
    h = make_swa_cache(enable_session=True, num_tokens=2048, sliding_window_size=8)
    h.run_request([1] * 8 + [11] * 16, session_id="cold")  # oldest
    warm = [h.run_request([2] * 8 + [20 + i] * 16) for i in range(3)]
    cold_nodes = [n for n in h.tree_nodes() if n.component_data[SWA].session_ref]
    assert cold_nodes
    h.cache.release_radix_session("cold")
    lru = h.cache.lru_lists[SWA]
    # The cold session's nodes are now the least recent unreferenced ones.
    first = lru.get_lru_no_lock()
    assert first in cold_nodes
    cold_tokens = sum(len(n.component_data[SWA].value) for n in cold_nodes)
    h.evict(swa_num_tokens=cold_tokens)
    for n in cold_nodes:
        assert n.component_data[SWA].value is None or n.parent is None
    for req in warm:
        assert h.match_len(list(req.origin_input_ids)) > 0
    h.cache.validate_session_state()


def test_registration_keeps_recency_inside_referenced_partition():
    h = make_swa_cache(enable_session=True, num_tokens=2048, sliding_window_size=8)
    a = h.run_request([1] * 8 + [11] * 16, session_id="a")
    h.run_request([2] * 8 + [22] * 16, session_id="b")
    # Touch a's path: it becomes the most recent referenced entry.
    h.match_len(list(a.origin_input_ids))
    lru = h.cache.lru_lists[SWA]
    x = lru.head.lru_next[lru._pt]
    assert "a" in h.cache.session_ref_tracker.components[SWA].coverage().get(x, {})
    assert not lru.integrity_errors("device")
