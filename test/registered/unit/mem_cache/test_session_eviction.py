"""Session-aware eviction on the real UnifiedRadixCache: unreferenced first per
component (device and host lists), soft protection, partition invariants,
cascade protection, and flag-off order identical to unpatched sglang 0.5.16."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cache_fixtures import (  # noqa: E402
    make_full_cache,
    make_swa_cache,
    make_swa_mamba_cache,
)
from session_test_utils import separate_leaf_indexes  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache.component_refs import SessionStateError  # noqa: E402
from sglang_session_cache.partitioned_lru import PartitionedLRUList  # noqa: E402
from sglang_session_cache.session_eviction import (  # noqa: E402
    cascade_blocked,
    full_eviction_key,
)

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def leaf_of(h, sid, ct=FULL):
    (leaf,) = h.cache.session_ref_tracker.session_leaves(sid, ct)
    return leaf


def in_tree(h, node):
    return any(n is node for n in h.tree_nodes())


def serve(h, tokens, sid=None, n_decode=0):
    return h.run_request(tokens, session_id=sid, n_decode=n_decode)


# ---- FULL -------------------------------------------------------------------------


def test_full_evicts_unreferenced_before_older_referenced():
    h = make_full_cache(enable_session=True, num_tokens=512)
    serve(h, [1] * 4 + list(range(10, 30)), sid="s")  # oldest
    others = [serve(h, [2] * 4 + [i] * 20) for i in range(3)]
    ref_leaf = leaf_of(h, "s")
    assert full_eviction_key(h.cache, ref_leaf)[0] is True
    freed = h.evict(num_tokens=40).num_tokens_evicted
    assert freed >= 40
    assert in_tree(h, ref_leaf), "referenced leaf evicted before unreferenced ones"
    lost = [o for o in others
            if h.match_len(list(o.origin_input_ids)) < len(o.origin_input_ids)]
    assert lost, "the eviction must have come from the unreferenced requests"
    h.cache.validate_session_state()


def test_full_prefers_least_shared_reference():
    h = make_full_cache(enable_session=True, num_tokens=512)
    shared = [5] * 24
    serve(h, shared, sid="a")
    serve(h, shared, sid="b")  # same leaf, count 2
    serve(h, [6] * 24, sid="c")  # newer, count 1
    shared_leaf, single_leaf = leaf_of(h, "a"), leaf_of(h, "c")
    assert shared_leaf is leaf_of(h, "b")
    assert shared_leaf.full_session_ref == 2 and single_leaf.full_session_ref == 1
    h.evict(num_tokens=10)
    assert in_tree(h, shared_leaf) and not in_tree(h, single_leaf)
    h.cache.validate_session_state()


def test_soft_protection_evicts_referenced_when_needed(shape_factory=make_full_cache):
    h = shape_factory(enable_session=True, num_tokens=256)
    for i in range(4):
        serve(h, [i + 1] * 30, sid=f"s{i}")
    before = h.cache.full_evictable_size()
    res = h.evict(num_tokens=before)
    assert res.num_tokens_evicted == before
    h.cache.validate_session_state()
    # References of fully evicted sessions are gone with their nodes.
    assert all(not refs.leaves for refs in h.cache.session_ref_tracker.components.values())


def _full_session_trace(generic: bool) -> list:
    """Sessions and evictions on a FULL cache; after each eviction, the token
    paths left.  ``generic``: the LRU policy through a subclass, so the heap
    drive takes its ``get_priority`` route instead of reading the attribute."""
    import random

    from sglang.srt.mem_cache.evict_policy import LRUStrategy

    class GenericLRU(LRUStrategy):
        pass

    h = make_full_cache(enable_session=True, num_tokens=384)
    if generic:
        h.cache.eviction_strategy = GenericLRU()
    else:
        assert type(h.cache.eviction_strategy) is LRUStrategy  # the fast path runs
    rng = random.Random(11)
    trace = []
    for step in range(80):
        base = rng.choice([[1] * 6, [2] * 6, [3] * 3])
        sid = rng.choice([None, "a", "b", "c"])
        serve(h, base + [rng.randrange(30) for _ in range(rng.randint(2, 12))], sid=sid,
              n_decode=rng.randint(0, 3))
        if step % 4 == 3:
            h.evict(num_tokens=rng.randint(4, 40))
            trace.append(sorted(
                tuple(n.key.token_ids) for n in h.tree_nodes() if n is not h.cache.root_node))
    h.cache.validate_session_state()
    return trace


def test_full_lru_fast_path_keeps_the_generic_order():
    assert _full_session_trace(generic=False) == _full_session_trace(generic=True)


# ---- SWA ----------------------------------------------------------------------------


def swa_cache(**kw):
    kw.setdefault("num_tokens", 512)
    kw.setdefault("sliding_window_size", 8)
    return make_swa_cache(enable_session=True, **kw)


def test_swa_tombstones_unreferenced_windows_first():
    h = swa_cache()
    serve(h, [1] * 8 + list(range(100, 140)), sid="s")
    for i in range(3):
        serve(h, [2] * 8 + [200 + i] * 40)
    lru = h.cache.lru_lists[SWA]
    assert isinstance(lru, PartitionedLRUList)
    referenced = [n for n in h.tree_nodes() if n.component_data[SWA].session_ref]
    assert referenced
    h.evict(swa_num_tokens=48)
    for n in referenced:
        assert n.component_data[SWA].value is not None, "referenced SWA evicted first"
    h.cache.validate_session_state()
    # Soft: asking for everything reaches the referenced window too.
    h.evict(swa_num_tokens=h.cache.swa_evictable_size())
    assert all(n.component_data[SWA].value is None for n in referenced if in_tree(h, n))
    h.cache.validate_session_state()


def test_swa_first_candidate_is_reached_without_scanning_referenced():
    h = swa_cache(num_tokens=2048)
    for i in range(20):
        serve(h, [i + 1] * 8 + [300 + i] * 8, sid=f"s{i}")
    serve(h, [99] * 16)  # one unreferenced entry, the most recent
    lru = h.cache.lru_lists[SWA]
    first = lru.get_lru_no_lock()
    assert first.component_data[SWA].session_ref == 0
    # Everything between the tail and it is unreferenced; the referenced
    # partition sits entirely behind the mid sentinel.
    x, hops = lru.tail.lru_prev[lru._pt], 0
    while x is not first:
        hops += 1
        x = x.lru_prev[lru._pt]
    assert hops == 0


# ---- Mamba ------------------------------------------------------------------------------


def test_mamba_evicts_unreferenced_state_first():
    h = make_swa_mamba_cache(enable_session=True, num_tokens=512, mamba_num_slots=24)
    serve(h, [1] * 12, sid="s")
    for i in range(3):
        serve(h, [2] * 6 + [50 + i] * 6)
    ref_leaf = leaf_of(h, "s", MAMBA)
    h.evict(mamba_num=2)
    assert ref_leaf.component_data[MAMBA].value is not None
    h.cache.validate_session_state()
    h.evict(mamba_num=h.cache.mamba_evictable_size())
    h.cache.validate_session_state()


# ---- host lists -------------------------------------------------------------------------


def test_host_lru_partition_orders_unreferenced_first():
    h = swa_cache()
    serve(h, [1] * 8 + [10] * 16, sid="s")
    serve(h, [2] * 8 + [20] * 16)
    host = h.cache.host_lru_lists[SWA]
    assert isinstance(host, PartitionedLRUList) and host._pt != h.cache.lru_lists[SWA]._pt
    nodes = [n for n in h.tree_nodes() if n is not h.cache.root_node]
    ref = [n for n in nodes if n.component_data[SWA].session_ref]
    unref = [n for n in nodes if not n.component_data[SWA].session_ref]
    assert ref and unref
    for n in ref + unref:  # referenced inserted last = most recent
        host.insert_mru(n)
    order = []
    x = host.get_lru_no_host_lock()
    while x is not None:
        order.append(x)
        x = host.get_prev_no_host_lock(x)
    assert order[: len(unref)] == unref  # unreferenced, least recent first
    assert set(order[len(unref):]) == set(ref)
    assert not host.integrity_errors("host")
    # Closing the session moves its nodes to the unreferenced partition.
    h.cache.release_radix_session("s")
    assert not host.integrity_errors("host")
    for n in ref + unref:
        host.remove_node(n)


# ---- partition invariants ------------------------------------------------------------------


def test_validator_catches_a_node_in_the_wrong_partition():
    h = swa_cache()
    serve(h, [1] * 8 + [10] * 16, sid="s")
    lru = h.cache.lru_lists[SWA]
    node = next(n for n in h.tree_nodes() if n.component_data[SWA].session_ref)
    lru._remove_node(node)
    lru._add_node_after(lru.mid, node)  # referenced node in the unreferenced part
    with pytest.raises(SessionStateError, match="unreferenced partition"):
        h.cache.validate_session_state()
    lru.move_to_partition(node)
    h.cache.validate_session_state()
    h.cache.sanity_check()  # SGLang's own check understands the sentinels


# ---- cascade protection -----------------------------------------------------------------------


def test_swa_leaf_eviction_spares_referenced_full_until_needed():
    h = separate_leaf_indexes(swa_cache())
    victim = serve(h, [1] * 8 + [10] * 16)
    serve(h, [2] * 8 + [20] * 16)
    tracker = h.cache.session_ref_tracker
    tracker.open_radix_session("full-only")
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_session_cache.patches.unified_cache import locate_node

    ids = list(victim.origin_input_ids)[: (len(victim.origin_input_ids) // 4) * 4]
    key = RadixKey(array("q", ids))
    node = locate_node(h.cache, key)
    assert node in h.cache.evictable_device_leaves
    # A FULL-only reference: the leaf's SWA window is unreferenced, its FULL
    # path is referenced (as with a host-resident session leaf below it).
    tracker.components[FULL].register_session_leaf("full-only", node)
    swa_comp = h.cache.components[SWA]
    assert node.component_data[SWA].session_ref == 0
    assert cascade_blocked(h.cache, node, swa_comp)

    h.evict(swa_num_tokens=8)
    assert in_tree(h, node), "unreferenced SWA eviction took a referenced FULL leaf"
    h.cache.validate_session_state()
    # Soft: when nothing else is left, the second pass takes it.
    h.evict(swa_num_tokens=h.cache.swa_evictable_size())
    assert not in_tree(h, node) or node.component_data[SWA].value is None
    h.cache.validate_session_state()


def test_cascade_rule_table():
    h = separate_leaf_indexes(make_swa_mamba_cache(enable_session=True, num_tokens=512))
    serve(h, [1] * 16, sid="s")
    serve(h, [1] * 8 + [3] * 8)  # makes [1]*8 an internal node
    tracker = h.cache.session_ref_tracker
    swa, mamba = h.cache.components[SWA], h.cache.components[MAMBA]
    leaf = leaf_of(h, "s")
    internal = leaf.parent
    assert leaf in h.cache.evictable_device_leaves
    assert internal not in h.cache.evictable_device_leaves
    # Trigger referenced itself: never blocked.
    assert not cascade_blocked(h.cache, leaf, swa)
    assert not cascade_blocked(h.cache, leaf, mamba)
    tracker.release_radix_session("s")
    tracker.open_radix_session("t")
    # Mamba-only reference on the leaf: an SWA-triggered leaf eviction may take
    # the lower tier along (cascade rule unchanged) ...
    tracker.components[MAMBA].register_session_leaf("t", leaf)
    assert not cascade_blocked(h.cache, leaf, swa)
    # ... and SWA referenced blocks an unreferenced Mamba trigger on a leaf.
    tracker.components[MAMBA].release_session("t")
    tracker.components[SWA].register_session_leaf("t", leaf)
    assert leaf.component_data[MAMBA].session_ref == 0
    assert cascade_blocked(h.cache, leaf, mamba)
    # Internal nodes: a trigger only cascades to lower tiers, never blocked.
    tracker.components[FULL].register_session_leaf("t", internal)
    assert not cascade_blocked(h.cache, internal, swa)
    assert not cascade_blocked(h.cache, internal, mamba)
    h.cache.validate_session_state()


# ---- flag off == unpatched 0.5.16 -------------------------------------------------------------


def eviction_trace(enable_session=False) -> list:
    """A fixed op sequence on a FULL+SWA+Mamba cache; after each eviction the
    tree's state as data (token paths and which components hold data)."""
    import random

    rng = random.Random(7)
    h = make_swa_mamba_cache(enable_session=enable_session, num_tokens=384,
                             mamba_num_slots=20, sliding_window_size=8)
    trace = []

    def snapshot():
        out = []
        stack = [(h.cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + tuple(node.key.token_ids) if node.key is not None else prefix
            if node is not h.cache.root_node:
                out.append([list(path),
                            [node.component_data[ct].value is not None
                             for ct in h.cache.tree_components]])
            stack.extend((c, path) for c in node.children.values())
        return sorted(out)

    for step in range(60):
        base = rng.choice([[1] * 8, [2] * 8, [3] * 4])
        tokens = base + [rng.randrange(20) for _ in range(rng.randint(2, 10))]
        h.run_request(tokens, session_id=None, n_decode=rng.randint(0, 3),
                      output_ids=[900 + step, 901 + step, 902 + step, 903 + step])
        if step % 5 == 4:
            res = h.evict(num_tokens=rng.randint(4, 24), swa_num_tokens=rng.randint(2, 12),
                          mamba_num=rng.randint(0, 2))
            trace.append([[res.num_tokens_evicted, res.swa_num_tokens_evicted,
                           res.mamba_num_evicted], snapshot()])
    return trace


def test_flag_off_eviction_order_matches_unpatched_sglang():
    code = (
        "import json, sys; sys.path.insert(0, %r); "
        "from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache; "
        "import test_session_eviction as t; "
        "print(json.dumps({'patched': hasattr(UnifiedRadixCache, 'session_ref_tracker'), "
        "'trace': t.eviction_trace()}))" % HERE
    )
    runs = {}
    for label, extra in (("stock", {"SGLANG_SESSION_CACHE_DISABLE": "1"}), ("ours", {})):
        env = {**os.environ, **extra}
        env.pop("SGLANG_SESSION_CACHE_DISABLE", None) if not extra else None
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["stock"]["patched"] is False, "control run must be unpatched sglang"
    assert runs["ours"]["patched"] is True
    assert runs["stock"]["trace"] == runs["ours"]["trace"]
    assert len(runs["ours"]["trace"]) == 12
