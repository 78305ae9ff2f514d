"""FULL's device leaf heap, kept from one eviction to the next.

0.5.16 rebuilds FULL's heap from every evictable device leaf on each
``evict`` call: one key per leaf in Python, however few leaves the call
evicts.  A session cache calls ``evict`` more often, for less (admission
evicts the shortfall, ``patches/admission_eviction.py``), so with sessions on
and the default LRU policy the heap is kept instead and only what changed
since the last call is pushed.  The leaves evicted are the rebuild's.

Keys are ``(full_session_ref, last_access_time, node.id)``: the session key
of ``session_eviction`` with the node id breaking ties, so the order never
depends on set iteration (node addresses differ between TP/PP ranks).

Invariant: every evictable leaf in ``tracked`` has an entry whose key is at
most its current key.  ``last_access_time`` only grows (a global counter);
a reference count that goes down is recorded by ``FullSessionRefs`` in
``lowered`` and pushed again.  A popped entry whose key is stale is pushed
again with the current key; one whose node is no longer a leaf is dropped.
So an entry popped with its current key is the minimum over the leaves.

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


def _entry(node) -> tuple:
    return (node.full_session_ref, node.last_access_time, node.id, node)


class FullLeafHeap:
    def __init__(self):
        self.heap: list = []
        self.tracked: set = set()  # nodes with at least one entry
        self.leaves = None  # the cache's leaf set the entries describe

    def _rebuild(self, leaves: set, lowered: set) -> None:
        self.heap = [_entry(n) for n in leaves]
        heapq.heapify(self.heap)
        self.tracked = set(leaves)
        self.leaves = leaves
        lowered.clear()

    def _push_lowered(self, leaves: set, lowered: set) -> None:
        heap, tracked = self.heap, self.tracked
        for n in lowered:
            if n in leaves:
                heapq.heappush(heap, _entry(n))
                tracked.add(n)
            else:
                # Not a leaf now: its old entry is too high, so it gets a
                # fresh one when it is a leaf again (``drive``'s new leaves).
                tracked.discard(n)
        lowered.clear()

    def drive(self, leaves: set, lowered: set, evict_leaf, request: int,
              tracker: dict, ct) -> None:
        """0.5.16's ``FullComponent.drive_eviction`` loop on the kept heap."""
        if leaves is not self.leaves or len(self.heap) > 2 * len(leaves) + _SLACK:
            self._rebuild(leaves, lowered)  # first call, a reset tree, or compaction
        else:
            if lowered:
                self._push_lowered(leaves, lowered)
            new = leaves - self.tracked
            if new:
                if len(new) * 8 > len(self.heap):  # many: one heapify
                    self.heap.extend(_entry(n) for n in new)
                    heapq.heapify(self.heap)
                else:
                    for n in new:
                        heapq.heappush(self.heap, _entry(n))
                self.tracked |= new
        heap, tracked = self.heap, self.tracked
        try:
            while tracker[ct] < request and heap:
                entry = heapq.heappop(heap)
                x = entry[3]
                if x not in leaves:
                    tracked.discard(x)
                    continue
                if entry[0] != x.full_session_ref or entry[1] != x.last_access_time:
                    heapq.heappush(heap, _entry(x))  # touched since: a later turn
                    continue
                evict_leaf(x, tracker)
                tracked.discard(x)
                if lowered:  # references moved up from the deleted leaf
                    self._push_lowered(leaves, lowered)
                parent = x.parent
                if parent is not None and parent in leaves:
                    heapq.heappush(heap, _entry(parent))
                    tracked.add(parent)
        except BaseException:
            self.leaves = None  # an entry may be lost: rebuild next call
            raise
