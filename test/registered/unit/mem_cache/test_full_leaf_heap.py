"""FULL's leaf heap kept across evictions (full_leaf_heap.py) evicts exactly
the leaves 0.5.16's per-call rebuild (with the session key) evicts.

Two real session caches replay the same random scheduler traffic in
lockstep -- session turns, one-shots, decode, finishes, closes, lookups that
touch paths, admissions that evict, explicit evictions -- one with the kept
heap, one rebuilding the heap on every call; every evicted leaf (by its
token path) and the trees must agree after every step."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES  # noqa: E402

from sglang_session_cache import full_leaf_heap, session_eviction  # noqa: E402

SESSIONS = [f"s{i}" for i in range(5)]


def _path(node) -> tuple:
    out = []
    while node.parent is not None:
        out[:0] = node.key.token_ids
        node = node.parent
    return tuple(out)


class Side:
    def __init__(self, shape: str, rebuild: bool):
        self.h = SHAPES[shape](num_tokens=384)
        cache = self.h.cache
        full = cache.components[0]
        if rebuild:
            # 0.5.16's loop: the heap rebuilt from every leaf on each call.
            full.drive_eviction = lambda params, tracker: session_eviction._full_heap_drive(
                full, cache.evictable_device_leaves, cache._evict_device_leaf,
                params.num_tokens, tracker)
        self.evicted = []
        inner = cache._evict_device_leaf

        def record(node, tracker):
            self.evicted.append(_path(node))
            return inner(node, tracker)

        cache._evict_device_leaf = record
        self.live = {}

    def signature(self):
        tracker = self.h.cache.session_ref_tracker
        nodes = []
        stack = [self.h.cache.root_node]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                refs = tuple(child.component_data[ct].session_ref for ct in tracker.components)
                nodes.append((_path(child), refs, child.component_data[0].value is not None))
                stack.append(child)
        return sorted(nodes), self.evicted


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_heap_evicts_what_the_rebuild_evicts(shape, seed):
    rng = random.Random(seed)
    sides = [Side(shape, rebuild=False), Side(shape, rebuild=True)]
    history = {sid: list(range(1000 * (i + 1), 1000 * (i + 1) + 12))
               for i, sid in enumerate(SESSIONS)}
    fresh = iter(range(100_000, 10**9))
    calls = 0
    for step in range(700):
        op = rng.random()
        kept, rebuilt = sides
        if op < 0.35 and len(kept.live) < 2:  # a session turn or a one-shot
            sid = rng.choice(SESSIONS + [None])
            if sid is None:
                prompt = [next(fresh) for _ in range(rng.randrange(6, 40))]
            else:
                if len(history[sid]) > 100:  # a new conversation on the same system prompt
                    del history[sid][12:]
                history[sid] += [next(fresh) for _ in range(rng.randrange(4, 30))]
                prompt = list(history[sid])
            rid = f"r{step}"
            for side in sides:
                req = side.h.new_req(prompt, session_id=sid, rid=rid)
                side.h.prefill(req)
                side.live[rid] = req
        elif op < 0.6 and kept.live:  # decode or finish one
            rid = rng.choice(sorted(kept.live))
            finish = rng.random() < 0.6
            steps = rng.randrange(1, 6)
            for side in sides:
                req = side.live[rid]
                if finish:
                    side.h.finish(req)
                    del side.live[rid]
                else:
                    side.h.decode(req, steps)
        elif op < 0.7:  # a close: references go, keys come down
            sid = rng.choice(SESSIONS)
            for side in sides:
                side.h.cache.session_ref_tracker.release_radix_session(sid)
        elif op < 0.8:  # a lookup touches a path
            sid = rng.choice(SESSIONS)
            cut = rng.randrange(1, len(history[sid]) + 1)
            assert len({side.h.match_len(history[sid][:cut]) for side in sides}) == 1
        else:  # memory pressure
            k = rng.randrange(1, 64)
            results = [side.h.evict(num_tokens=k) for side in sides]
            assert results[0] == results[1], (step, results)
            calls += 1
        a, b = (side.signature() for side in sides)
        assert a == b, f"{shape}: kept heap and rebuild diverged at step {step} (seed {seed})"
    for side in sides:
        for req in list(side.live.values()):
            side.h.finish(req)
        side.h.cache.validate_session_state()
        side.h.check()
    assert len(sides[0].evicted) > 50 and calls > 50


def test_a_count_going_down_reorders_a_kept_entry():
    """A referenced old leaf waits behind newer unreferenced ones; once its
    session closes, the next call evicts it first, as a rebuild would."""
    h = SHAPES["full"](num_tokens=256)
    tracker = h.cache.session_ref_tracker
    old = list(range(1000, 1010))
    for turn in range(2):  # turn 2 earns protection (the turn rule)
        old += [2000 + turn]
        h.run_request(old, session_id="s")
    h.run_request(list(range(3000, 3010)))
    h.run_request(list(range(4000, 4010)))
    paths = []
    inner = h.cache._evict_device_leaf

    def record(node, t):
        paths.append(_path(node)[0])
        return inner(node, t)

    h.cache._evict_device_leaf = record
    h.evict(num_tokens=1)
    assert paths == [3000]  # unreferenced first, though newer
    assert h.cache._session_leaf_heap is not None
    tracker.release_radix_session("s")
    h.evict(num_tokens=1)
    assert paths == [3000, 1000]  # now plain LRU: the session's leaf is oldest


def test_the_heap_is_kept_and_rebuilt_only_when_needed(monkeypatch):
    builds = []
    real = full_leaf_heap.FullLeafHeap._rebuild
    monkeypatch.setattr(full_leaf_heap.FullLeafHeap, "_rebuild",
                        lambda self, *a: (builds.append(1), real(self, *a)))
    h = SHAPES["full"](num_tokens=512)
    for i in range(20):
        h.run_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
    for _ in range(10):
        h.evict(num_tokens=1)
    assert len(builds) == 1
    h.cache.reset()  # a new tree and leaf set: built again
    h.run_request(list(range(50, 60)))
    h.evict(num_tokens=1)
    assert len(builds) == 2


def test_the_heap_keeps_no_evicted_leaf_alive():
    import gc
    import weakref

    h = SHAPES["full"](num_tokens=256)
    for i in range(6):
        h.run_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
    h.evict(num_tokens=1)  # the heap is built and kept
    kept = list(h.cache.evictable_device_leaves)
    # One the heap holds, deleted outside FULL's drive (as SWA and Mamba
    # walks do), and one that reaches the heap as new.
    outside = max(kept, key=lambda n: n.last_access_time)
    h.run_request(list(range(9000, 9008)))
    new = [n for n in h.cache.evictable_device_leaves if n not in kept]
    refs = [weakref.ref(n) for n in kept + new]
    h.cache._evict_device_leaf(outside, {ct: 0 for ct in h.cache.tree_components})
    del kept, new, outside
    gc.collect()
    assert refs[-1]() is not None and sum(r() is None for r in refs) == 1
    h.evict(num_tokens=h.full_allocator.size)
    gc.collect()
    assert not h.cache.evictable_device_leaves
    assert all(r() is None for r in refs)


def test_a_tree_reset_leaves_no_old_node_in_the_heap():
    """A reset (``/flush_cache``) drops the whole tree; the kept heap must
    not hold it in memory until the next eviction, which an empty pool may
    not need for a long time."""
    import gc
    import weakref

    h = SHAPES["full"](num_tokens=256)
    for i in range(6):
        h.run_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
    h.evict(num_tokens=1)  # the heap is built and kept
    h.run_request(list(range(9000, 9008)))  # one more, reported as new
    refs = [weakref.ref(n) for n in h.cache.evictable_device_leaves]
    assert len(refs) == 6
    h.cache.reset()  # what /flush_cache does, with the pools cleared
    h.full_allocator.clear()
    gc.collect()
    assert all(r() is None for r in refs)
    # And the heap works on the new tree.
    for i in range(3):
        h.run_request(list(range(2000 * (i + 1), 2000 * (i + 1) + 8)))
    assert h.evict(num_tokens=1).num_tokens_evicted == 8
    h.check()


def test_a_leaf_that_bypassed_the_update_is_still_evicted():
    """The heap learns of new leaves through SGLang's leaf-set update; one
    that got into the set another way is found once the heap runs dry."""
    h = SHAPES["full"](num_tokens=256)
    for i in range(4):
        h.run_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
    h.evict(num_tokens=1)
    del h.cache._update_evictable_leaf_sets  # SGLang's own again: no reports
    for i in range(4):
        h.run_request(list(range(5000 + 100 * i, 5000 + 100 * i + 8)))
    freed = h.evict(num_tokens=h.full_allocator.size).num_tokens_evicted
    assert freed == 7 * 8
    assert not h.cache.evictable_device_leaves
    h.check()


def test_other_policies_and_replaced_leaf_updates_keep_the_rebuild():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    h = SHAPES["full"](num_tokens=256, eviction_policy="lfu")
    assert h.cache._session_leaf_heap is None
    assert "_update_evictable_leaf_sets" not in vars(h.cache)
    for i in range(4):
        h.run_request(list(range(1000 * (i + 1), 1000 * (i + 1) + 8)))
    assert h.evict(num_tokens=9).num_tokens_evicted == 16
    h.check()

    class OwnLeafRules(UnifiedRadixCache):
        def _update_evictable_leaf_sets(self, node):
            return super()._update_evictable_leaf_sets(node)

    heap = full_leaf_heap.FullLeafHeap()
    assert full_leaf_heap.make_leaf_set_update(OwnLeafRules, heap) is None
