"""Deleted session leaves hand over to their parent, on the real
UnifiedRadixCache.

Eviction moves the counts of a deleted session leaf at once (for all its
references together), then each session's index entry.  What a session
protects must be what moving each reference on its own gives: FULL and SWA
move to the nearest ancestor still holding KV, Mamba drops the reference
when no ancestor holds a state.  The fixture validates every count against
the leaf index after each test."""

import gc
import os
import sys
import weakref

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import (  # noqa: E402,F401 (checked_harness: fixture h)
    SHAPES,
    arrive,
    checked_harness,
    done,
    finish,
)

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
SYSTEM = list(range(1000, 1040))


def tracker(h):
    return h.cache.session_ref_tracker


def two_branches(h, sid):
    """Two concurrent requests of ``sid`` (each arrives before the other
    registers): the session keeps both leaves, siblings under SYSTEM."""
    ra = arrive(h, SYSTEM + [1] * 8, sid)
    rb = arrive(h, SYSTEM + [2] * 8, sid)
    for req in (ra, rb):
        h.prefill(req, finishing=True)
    for req in (rb, ra):
        done(h, req)


def serve(h, tokens, sid):
    # Finishes at prefill: the session leaf is the prompt's own node.
    return finish(h, arrive(h, tokens, sid), n_decode=0)


def leaf(h, sid):
    (node,) = tracker(h).session_leaves(sid)
    return node


def delete(h, node):
    """Evict one device leaf whole, as the eviction walks do."""
    assert not node.children
    h.cache._evict_device_leaf(node, {ct: 0 for ct in h.cache.tree_components})


def expected_leaves(h, node):
    """What the eager hand-over gave a session whose leaf was deleted below
    ``node``: FULL and SWA move to it; Mamba only if it holds a state."""
    out = {FULL: {node}}
    comps = tracker(h).components
    if SWA in comps:
        out[SWA] = {node}
    if MAMBA in comps:
        out[MAMBA] = {node} if node.component_data[MAMBA].value is not None else set()
    return out


def assert_leaves(h, sid, want):
    for ct, nodes in want.items():
        assert tracker(h).session_leaves(sid, ct) == nodes, ct


def test_deleted_leaf_hands_over_to_its_parent(h):
    serve(h, SYSTEM + [1] * 8, "a")
    serve(h, SYSTEM + [2] * 8, "b")
    a = leaf(h, "a")
    parent = a.parent
    assert leaf(h, "b").parent is parent
    before = parent.component_data[FULL].session_ref
    gone = weakref.ref(a)
    delete(h, a)
    assert_leaves(h, "a", expected_leaves(h, parent))
    assert parent.component_data[FULL].session_ref == before == 2  # a and b
    # Nothing of ours keeps the deleted node: it is freed with the eviction.
    del a
    gc.collect()
    assert gone() is None


def test_chain_of_deletions_ends_on_the_live_ancestor(h):
    serve(h, SYSTEM + [1] * 8, "a")
    serve(h, SYSTEM + [2] * 8, "b")
    serve(h, SYSTEM[:20] + [3] * 20, "c")  # splits SYSTEM: root - S1 - S2 - {a, b}
    a, b = leaf(h, "a"), leaf(h, "b")
    s2 = a.parent
    s1 = s2.parent
    assert b.parent is s2 and s1.parent is h.cache.root_node
    delete(h, a)
    delete(h, b)
    delete(h, s2)  # now a leaf itself, holding a and b
    for sid in ("a", "b"):
        assert_leaves(h, sid, expected_leaves(h, s1))
    assert s1.component_data[FULL].session_ref == 3


def test_deletion_under_the_root_drops_the_reference(h):
    serve(h, SYSTEM + [1] * 8, "a")
    serve(h, SYSTEM + [2] * 8, "b")
    a, b = leaf(h, "a"), leaf(h, "b")
    top = a.parent
    assert top.parent is h.cache.root_node
    delete(h, a)
    delete(h, b)
    delete(h, top)  # no ancestor below the root: the sessions keep nothing
    for sid in ("a", "b"):
        assert_leaves(h, sid, {ct: set() for ct in tracker(h).components})
    for refs in tracker(h).components.values():
        assert refs.ref_units == 0
    assert tracker(h).open_sessions() == ["a", "b"]  # still open, just unprotected


def test_two_branches_of_one_session_meet_on_their_parent(h):
    # Concurrent requests of one session keep both leaves; deleting both
    # lands both entries on the parent, counted once (SWA counts leaf
    # references: the second one must be taken back).
    two_branches(h, "s")
    a, b = sorted(tracker(h).session_leaves("s"), key=lambda n: n.id)
    parent = a.parent
    assert b.parent is parent
    delete(h, a)
    delete(h, b)
    assert_leaves(h, "s", expected_leaves(h, parent))
    if SWA in tracker(h).components:
        assert parent.component_data[SWA].session_below == {0: 1}


def test_next_turn_after_a_deletion_keeps_only_the_new_leaf(h):
    serve(h, SYSTEM + [1] * 8, "a")
    serve(h, SYSTEM + [2] * 8, "b")
    a = leaf(h, "a")
    delete(h, a)
    nxt = serve(h, SYSTEM + [1] * 8 + [4] * 8, "a")
    new = leaf(h, "a")
    assert new is not a
    for refs in tracker(h).components.values():
        assert list(refs.leaves.get("a", {})) in ([new], []), refs.ct
    assert len(nxt.origin_input_ids) == 56


def test_close_after_a_deletion_releases_everything(h):
    serve(h, SYSTEM + [1] * 8, "a")
    a = leaf(h, "a")
    serve(h, SYSTEM + [2] * 8, "b")
    delete(h, a)
    assert h.cache.release_radix_session("a") >= 0
    h.cache.release_radix_session("b")
    for refs in tracker(h).components.values():
        assert refs.leaves == {} and refs.ref_units == 0
    assert all(
        cd.session_ref == 0 for n in h.tree_nodes() for cd in n.component_data
    )


def test_a_leaf_shared_by_many_sessions_hands_all_of_them_over(h):
    # Same prompt, ten sessions: one leaf, ten references, moved together.
    sids = [f"s{i}" for i in range(10)]
    for sid in sids:
        serve(h, SYSTEM + [1] * 8, sid)
    two_branches(h, "t")  # "t" holds the shared leaf and a sibling
    shared = leaf(h, "s0")
    parent = shared.parent
    assert shared in tracker(h).session_leaves("t")
    delete(h, shared)
    for sid in sids:
        assert_leaves(h, sid, expected_leaves(h, parent))
    assert parent.component_data[FULL].session_ref == 11
    if SWA in tracker(h).components:
        # the eleven moved references, now at distance 0
        assert parent.component_data[SWA].session_below[0] == 11


def _state(h):
    """What eviction reads and what sessions hold, by token content (node ids
    differ between two caches)."""
    t = tracker(h)

    def path(node):
        out = []
        while node is not h.cache.root_node:
            out.append(tuple(node.key.token_ids))
            node = node.parent
        return tuple(reversed(out))

    nodes = {path(n): n for n in h.tree_nodes() if n is not h.cache.root_node}
    counts = {
        p: tuple(
            cd.session_ref if ct == FULL else cd.session_ref > 0
            for ct, cd in enumerate(n.component_data)
        )
        for p, n in nodes.items()
    }
    leaves = {
        (sid, ct): sorted(path(n) for n in t.session_leaves(sid, ct))
        for sid in t.open_sessions() for ct in t.components
    }
    return counts, leaves


def two_ranks(shape):
    """Two identical trees (as two TP/PP ranks keep): a session with two
    branches and three one-leaf sessions sharing part of SYSTEM."""
    ranks = [SHAPES[shape](), SHAPES[shape]()]
    for h in ranks:
        two_branches(h, "s")
        for i in range(3):
            serve(h, SYSTEM[:20] + [i + 5] * 16, f"o{i}")
    return ranks


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_metrics_scrape_on_one_rank_changes_nothing_eviction_reads(shape):
    # TP/PP ranks keep identical trees; a metrics scrape runs on one rank
    # only, at its own time, and must not change what eviction reads.
    ranks = two_ranks(shape)
    for step in range(4):
        for i, h in enumerate(ranks):
            h.evict(num_tokens=8, swa_num_tokens=8, mamba_num=1)
            if i == 0:
                h.cache.session_metrics()
        assert _state(ranks[0]) == _state(ranks[1]), step
    for h in ranks:
        serve(h, SYSTEM + [1] * 8 + [9] * 8, "s")
        h.evict(num_tokens=16, swa_num_tokens=16, mamba_num=1)
    assert _state(ranks[0]) == _state(ranks[1])
    for h in ranks:
        h.cache.validate_session_state()
        h.check()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_session_leaf_evictor_matches_sglangs_method_with_the_hooks(shape):
    # A session cache deletes device leaves through its own _evict_device_leaf
    # (on the instance, the session hooks in line).  Two identical trees,
    # one evicted through it, one through SGLang's method with the same
    # hooks as wrappers: the same tree, references, freed tokens and
    # breach counters afterwards.
    ranks = two_ranks(shape)
    for h in ranks:
        finish(h, h.new_req(SYSTEM[:20] + [9] * 16), n_decode=0)  # no session
    own, other = (h.cache for h in ranks)
    assert "_evict_device_leaf" in own.__dict__
    stock = type(other)._evict_device_leaf
    freed = []
    for h, evict in ((ranks[0], own._evict_device_leaf),
                     (ranks[1], lambda node, t: stock(other, node, t))):
        tracked = {ct: 0 for ct in h.cache.tree_components}
        for _ in range(3):
            leaves = sorted(h.cache.evictable_device_leaves,
                            key=lambda n: tuple(n.key.token_ids))
            for node in leaves:
                evict(node, tracked)
        freed.append(tracked)
    assert freed[0] == freed[1]
    assert _state(ranks[0]) == _state(ranks[1])
    counts = [tracker(h).breaches for h in ranks]
    assert counts[0] == counts[1]
    assert counts[0][FULL][0] > 0  # referenced leaves went: breaches counted
    for h in ranks:
        h.cache.validate_session_state()
        h.check()


def test_a_cache_without_sessions_keeps_sglangs_leaf_eviction():
    from cache_fixtures import make_full_cache

    cache = make_full_cache(enable_session=False).cache
    assert "_evict_device_leaf" not in cache.__dict__
    assert cache._evict_device_leaf.__func__ is type(cache)._evict_device_leaf
