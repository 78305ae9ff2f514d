"""Partition moves land where recency puts them, found through the list or
a partition snapshot: a real ``PartitionedLRUList`` driven with random MRU
placements, chain refreshes, reference flips, removals and walks' cursors,
checked after every step against an independent model (each partition
ordered by the last MRU event of its nodes) and against a second list that
always takes the list search.  The list search hands over to the snapshot
after two steps here (32 in the product), so snapshots are taken, go stale
and are used throughout."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import session_test_utils  # noqa: E402,F401  (activates the patches)

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode  # noqa: E402

from sglang_session_cache import partitioned_lru  # noqa: E402
from sglang_session_cache.partitioned_lru import PartitionedLRUList  # noqa: E402

CT = ComponentType.SWA
COMPONENTS = (ComponentType.FULL, ComponentType.SWA)


class Model:
    """Recency ranks and reference flags, nothing else."""

    def __init__(self):
        self.clock = 0
        self.rank = {}  # node id -> last MRU event
        self.ref = {}  # node id -> referenced

    def mru(self, node):
        self.clock += 1
        self.rank[node.id] = self.clock

    def chain(self, nodes):  # newest first, as _refresh_chain takes them
        for i, node in enumerate(nodes):
            self.rank[node.id] = self.clock + len(nodes) - i
        self.clock += len(nodes)

    def order(self):
        ids = sorted(self.rank, key=lambda i: -self.rank[i])
        return ([i for i in ids if self.ref[i]], [i for i in ids if not self.ref[i]])


def listed_order(lru):
    ref, unref, side = [], [], None
    for x in lru.iter_nodes():
        if x is lru.mid:
            side = unref
            continue
        if x is lru.cursor:
            continue
        (ref if side is None else side).append(x.id)
    return ref, unref


def _new_node():
    return UnifiedTreeNode(COMPONENTS)


def _set_ref(node, referenced):
    node.component_data[CT].session_ref = 1 if referenced else 0


@pytest.mark.parametrize("seed", range(4))
def test_moves_match_the_model_and_the_list_search(seed, monkeypatch):
    monkeypatch.setattr(partitioned_lru, "_SEARCH_STEPS", 2)
    rng = random.Random(seed)
    fast = PartitionedLRUList(CT, COMPONENTS)
    plain = PartitionedLRUList(CT, COMPONENTS)
    model = Model()
    # One node object per list (a node holds one pointer slot per list).
    pairs = {}  # model id -> (node in fast, node in plain)
    used = [0]
    real_anchor = PartitionedLRUList._anchor

    def counting_anchor(self, *a):
        found = real_anchor(self, *a)
        used[0] += found is not None
        return found

    monkeypatch.setattr(PartitionedLRUList, "_anchor", counting_anchor)
    for step in range(1500):
        listed = [i for i in pairs if i in model.rank]
        op = rng.random()
        if op < 0.2 or len(listed) < 4:
            a, b = _new_node(), _new_node()
            referenced = rng.random() < 0.4
            for n in (a, b):
                _set_ref(n, referenced)
            fast.insert_mru(a)
            plain.insert_mru(b)
            pairs[a.id] = (a, b)
            model.mru(a)
            model.ref[a.id] = referenced
        elif op < 0.4:
            i = rng.choice(listed)
            fast.reset_node_mru(pairs[i][0])
            plain.reset_node_mru(pairs[i][1])
            model.mru(pairs[i][0])
        elif op < 0.5:
            chain = rng.sample(listed, rng.randint(1, min(5, len(listed))))
            fast._refresh_chain([pairs[i][0] for i in chain])
            plain._refresh_chain([pairs[i][1] for i in chain])
            model.chain([pairs[i][0] for i in chain])
        elif op < 0.9:
            i = rng.choice(listed)
            referenced = not model.ref[i]
            model.ref[i] = referenced
            a, b = pairs[i]
            for n in (a, b):
                _set_ref(n, referenced)
            # The second list always takes the list search: a cursor linked
            # at its tail end (as during a host walk) keeps the snapshot out.
            plain.park_cursor_before(plain.tail.lru_prev[plain._pt])
            fast.move_to_partition(a)
            plain.move_to_partition(b)
            plain.detach_cursor()
            if rng.random() < 0.3:
                # And now and then the fast list moves with a cursor linked too.
                some = pairs[rng.choice(listed)][0]
                fast.park_cursor_before(some)
                fast.detach_cursor()
        else:
            i = rng.choice(listed)
            fast.remove_node(pairs[i][0])
            plain.remove_node(pairs[i][1])
            del model.rank[i]
        want = model.order()
        assert listed_order(fast) == want, f"step {step}"
        got_plain = listed_order(plain)
        ids = {b.id: a.id for a, b in pairs.values()}
        assert ([ids[i] for i in got_plain[0]], [ids[i] for i in got_plain[1]]) == want
        assert not fast.integrity_errors("fast") and not plain.integrity_errors("plain")
        # Ids and stamps only: a snapshot keeps no node alive.
        for stamps, snap_ids in fast._snapshots.values():
            assert all(type(e) is int for e in stamps + snap_ids)
    assert used[0] > 50  # the snapshot placed many of the moves


def test_mid_partition_moves_after_the_first_use_the_snapshot():
    """Nodes whose recency falls in the middle of a long partition (a
    released session's window): the first move searches the list and takes
    the snapshot; the next finds its place in a few steps, where the list
    search walks half the partition from each end."""
    lru = PartitionedLRUList(CT, COMPONENTS)
    nodes = []
    for k in range(2001):
        n = _new_node()
        _set_ref(n, k in (990, 1000))  # two referenced ones in the middle
        lru.insert_mru(n)
        nodes.append(n)
    _set_ref(nodes[990], False)
    lru.move_to_partition(nodes[990])  # the long search, then the snapshot
    assert False in lru._snapshots
    middle = nodes[1000]
    steps = []

    class Probe(list):  # counts the list links read
        def __getitem__(self, i):
            steps.append(1)
            return list.__getitem__(self, i)

    for n in nodes:
        if n is not middle:
            n.lru_next = Probe(n.lru_next)
            n.lru_prev = Probe(n.lru_prev)
    _set_ref(middle, False)
    steps.clear()
    lru.move_to_partition(middle)
    read = len(steps)
    assert [x.id for x in lru.iter_nodes() if x is not lru.mid] == [
        n.id for n in reversed(nodes)
    ]
    assert not lru.integrity_errors("lru")
    assert read < 3 * partitioned_lru._SEARCH_STEPS + 10, read  # the list search: ~2,000


def test_the_benchmark_moves_the_same_nodes_both_ways():
    """``structure_cost``'s move case: both lists end consistent, and the
    row reports the paired timings (no speed asserted here)."""
    from sglang_session_cache_bench import structure_cost

    (row,) = structure_cost.move_rows([600], referenced=20)
    assert row["case"] == "move" and row["n"] == 600 and row["moves"] >= 5
    assert row["search_us"] > 0 and row["move_us"] > 0 and row["ratio"] > 0
    assert "move/search" in structure_cost.format_table([], [], [row])
