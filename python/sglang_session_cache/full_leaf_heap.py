"""FULL's device leaf heap, kept from one eviction to the next.

0.5.16 rebuilds FULL's heap from every evictable device leaf on each
``evict`` call: one key per leaf in Python, however few leaves the call
evicts.  A session cache calls ``evict`` more often, for less (admission
evicts the shortfall, ``patches/admission_eviction.py``), so with sessions on
and the default LRU policy the heap is kept instead, and a call pushes only
what changed since the last one.  The leaves evicted are the rebuild's.

Entries are ``(full_session_ref, last_access_time, node id)``: the session
key of ``session_eviction`` with the node id breaking ties, so the order
never depends on set iteration (node addresses differ between TP/PP ranks).
Entries hold ids, not nodes; ``tracked`` maps the id of every node with an
entry to the node, and a deleted node is forgotten at once (``forget``), so
the heap keeps no node of the tree alive.

Invariant: every evictable leaf in ``tracked`` has an entry whose key is at
most its current key.  ``last_access_time`` only grows (a global counter);
a reference count that goes down is recorded by ``FullSessionRefs`` in
``lowered`` and pushed again; a node that becomes a leaf reaches ``fresh``
through SGLang's leaf-set update (``make_leaf_set_update``).  A popped entry
whose key is stale is pushed again with the current key; one whose node is
no longer a leaf is dropped.  So an entry popped with its current key is the
minimum over the leaves.

One difference from the rebuild, by design: a leaf that an eviction exposes
other than as the evicted leaf's parent (0.5.16 deletes a chain of
tombstones above it, with the host tier) can go in the same call if it is
the oldest; the rebuild only sees it from the next call on.
"""

from __future__ import annotations

import heapq

#: Rebuild when stale entries outnumber the leaves this much (amortized:
#: each entry was one push).
_SLACK = 64


def _key(node) -> tuple:
    return (node.full_session_ref, node.last_access_time, node.id)


class FullLeafHeap:
    def __init__(self):
        self.heap: list = []
        self.tracked: dict = {}  # node id -> node, for nodes with an entry
        self.leaves = None  # the cache's leaf set the entries describe
        # Nodes SGLang's leaf-set update found to be leaves since the last
        # call: the only way 0.5.16 adds one.  Never replaced (the update
        # holds this set).
        self.fresh: set = set()

    def clear(self) -> None:
        """The tree was reset: drop every entry now (the next call rebuilds
        from the new leaf set), so the old tree is not kept in memory until
        then -- after a flush the pool is empty and that call may be far off."""
        self.heap = []
        self.tracked = {}
        self.leaves = None
        self.fresh.clear()  # cleared in place: the leaf-set update holds it

    def forget(self, node) -> None:
        """``node`` is deleted from the tree: drop every reference to it."""
        self.tracked.pop(node.id, None)
        self.fresh.discard(node)

    def _rebuild(self, leaves: set, lowered: set) -> None:
        self.heap = [_key(n) for n in leaves]
        heapq.heapify(self.heap)
        self.tracked = {n.id: n for n in leaves}
        self.leaves = leaves
        self.fresh.clear()
        lowered.clear()

    def _push_lowered(self, leaves: set, lowered: set) -> None:
        heap, tracked = self.heap, self.tracked
        for n in lowered:
            if n in leaves:
                heapq.heappush(heap, _key(n))
                tracked[n.id] = n
            else:
                # Not a leaf now: its old entry is too high, so it gets a
                # new one when it is a leaf again (through ``fresh``).
                tracked.pop(n.id, None)
        lowered.clear()

    def _push_fresh(self, leaves: set) -> None:
        tracked = self.tracked
        new = [n for n in self.fresh if n in leaves and n.id not in tracked]
        self.fresh.clear()
        if len(new) * 8 > len(self.heap):  # many: one heapify
            self.heap.extend(_key(n) for n in new)
            heapq.heapify(self.heap)
        else:
            for n in new:
                heapq.heappush(self.heap, _key(n))
        for n in new:
            tracked[n.id] = n

    def drive(self, leaves: set, lowered: set, evict_leaf, request: int,
              tracker: dict, ct) -> None:
        """0.5.16's ``FullComponent.drive_eviction`` loop on the kept heap."""
        if leaves is not self.leaves or len(self.heap) > 2 * len(leaves) + _SLACK:
            self._rebuild(leaves, lowered)  # first call, a reset tree, or compaction
        else:
            if lowered:
                self._push_lowered(leaves, lowered)
            if self.fresh:
                self._push_fresh(leaves)
        try:
            self._evict(leaves, lowered, evict_leaf, request, tracker, ct)
            if tracker[ct] < request and leaves:
                # Every entry popped and still short: a leaf reached the set
                # some other way.  Look at them all once.
                self._rebuild(leaves, lowered)
                self._evict(leaves, lowered, evict_leaf, request, tracker, ct)
        except BaseException:
            self.leaves = None  # an entry may be lost: rebuild next call
            raise

    def _evict(self, leaves, lowered, evict_leaf, request, tracker, ct) -> None:
        heap, tracked = self.heap, self.tracked
        while tracker[ct] < request and heap:
            entry = heapq.heappop(heap)
            x = tracked.get(entry[2])
            if x is None:
                continue  # deleted, or a second entry of a dropped node
            if x not in leaves:
                del tracked[entry[2]]
                continue
            if entry[0] != x.full_session_ref or entry[1] != x.last_access_time:
                heapq.heappush(heap, _key(x))  # touched since: a later turn
                continue
            evict_leaf(x, tracker)  # deleted leaves are forgotten there
            tracked.pop(entry[2], None)  # demoted to host: no longer a leaf
            if lowered:  # references moved up from the deleted leaf
                self._push_lowered(leaves, lowered)
            parent = x.parent
            if parent is not None and parent in leaves:
                heapq.heappush(heap, _key(parent))
                tracked[parent.id] = parent


def make_leaf_set_update(cache_cls, heap: FullLeafHeap):
    """``_update_evictable_leaf_sets`` for one session cache (set on the
    instance): 0.5.16's update, by SGLang's own leaf rules
    (``_is_device_leaf`` / ``_is_host_leaf``), that also reports each device
    leaf to ``heap``, so a call pushes what changed instead of scanning the
    leaf set.  It runs on every lock, insert and split (about 18 times a
    request on the agentic trace), so the report costs one set insert and
    nothing else.  None where ``cache_cls`` replaced 0.5.16's method."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if cache_cls._update_evictable_leaf_sets is not UnifiedRadixCache._update_evictable_leaf_sets:
        return None
    fresh = heap.fresh

    def _update_evictable_leaf_sets(self, node):
        if self._is_device_leaf(node):
            self.evictable_device_leaves.add(node)
            fresh.add(node)
        else:
            self.evictable_device_leaves.discard(node)
        if self._is_host_leaf(node):
            self.evictable_host_leaves.add(node)
        else:
            self.evictable_host_leaves.discard(node)

    return _update_evictable_leaf_sets
