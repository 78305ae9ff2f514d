"""LRU list split into a referenced and an unreferenced partition.

Layout, head to tail (eviction walks from the tail)::

    head <-> referenced (MRU .. LRU) <-> mid <-> unreferenced (MRU .. LRU) <-> tail

``mid`` and ``cursor`` are sentinels whose lock refs (device and host) are
pinned at 1, so every stock walker (``get_prev_no_lock`` and friends) steps
over them.  The consequences:

* an eviction walk from the tail meets every unreferenced candidate before any
  referenced one, and crosses into the referenced partition without a separate
  scan — soft protection at the cost of one extra hop;
* a node whose reference state flips moves partitions in O(1);
* ``cursor`` marks the walk position while the node in front of it is evicted,
  so the walk survives neighbours being unlinked or moving partitions;
* moves between partitions keep recency: every MRU placement stamps the node
  with a list-wide counter (exactly when a plain LRU would move it to the
  front), and a node changing partition is inserted at its stamp's position.
  After all sessions close, the list order equals the plain LRU order of the
  same history.  The insertion is O(1) when the node is newer or older than
  everything in the target partition (fresh registrations, cold sessions
  closing) and otherwise searches from both ends at once.  A search that
  has not found the place within ``_SEARCH_STEPS`` steps (a released
  session's node amid a long partition: O(partition) before) asks a
  *snapshot* of the partition instead: its nodes' ids and stamps in order,
  taken by one pass and kept across moves.  A binary search there gives an
  anchor, a node of the partition just newer than the moving one; it is
  checked (still listed there, stamp unchanged) and the list is walked from
  it to the exact place, past anything placed since.  Without a usable
  snapshot the list search goes on, and a snapshot is taken after it when
  the search cost at least a quarter of taking one: so a snapshot never costs
  more than the searches it replaces, and the moves after the first long one
  are quick.  MRU placements pay nothing for this; the snapshot holds ids,
  so it keeps no node alive.

Only caches with ``--enable-session-radix-cache`` use this class; the stock
``UnifiedLRUList`` is untouched otherwise.
"""

from __future__ import annotations

from bisect import bisect_right

from sglang.srt.mem_cache.unified_radix_cache import UnifiedLRUList, UnifiedTreeNode

#: Steps of the two-end list search before a move asks the partition's
#: snapshot; also the most steps spent checking snapshot entries, and then
#: walking from an anchor, before the move goes back to the list search.
_SEARCH_STEPS = 32


def _make_sentinel(tree_components) -> UnifiedTreeNode:
    node = UnifiedTreeNode(tree_components)
    for cd in node.component_data:
        cd.lock_ref = 1
        cd.host_lock_ref = 1
    return node


class PartitionedLRUList(UnifiedLRUList):
    def __init__(self, component_type, tree_components, use_host_ptr: bool = False):
        super().__init__(component_type, tree_components, use_host_ptr=use_host_ptr)
        self.mid = _make_sentinel(tree_components)
        self.cursor = _make_sentinel(tree_components)
        self._add_node_after(self.head, self.mid)
        self._clock = 0  # recency stamps: larger = more recent
        # Per partition (True: referenced): (stamps ascending, node ids), or
        # absent until a long search needs one.
        self._snapshots: dict = {}
        # Partition moves so far: an eviction walk that saw this change knows
        # its precomputed next candidate may have moved.
        self.moves = 0

    def is_referenced(self, node: UnifiedTreeNode) -> bool:
        return node.component_data[self.component_type].session_ref > 0

    # Stamps live on the node, one slot per list pointer slot (device and
    # host lists of every component), so they vanish with the node.
    def stamp_of(self, node: UnifiedTreeNode) -> int:
        return node.lru_stamp[self._pt]

    # insert_mru / reset_node_mru both go through _add_node: an MRU placement.
    def _add_node(self, node: UnifiedTreeNode):
        pt = self._pt
        self._clock += 1
        stamps = node.lru_stamp  # class default None (apply_unified_cache)
        if stamps is None:
            stamps = node.lru_stamp = [0] * len(node.lru_prev)
        stamps[pt] = self._clock
        prev = (
            self.head
            if node.component_data[self.component_type].session_ref > 0
            else self.mid
        )
        nxt = prev.lru_next[pt]
        node.lru_prev[pt] = prev
        node.lru_next[pt] = nxt
        nxt.lru_prev[pt] = node
        prev.lru_next[pt] = node

    def _refresh_chain(self, nodes: list) -> None:
        """Move ``nodes`` (newest first) to the front of their partitions,
        keeping their relative order, as the stock chain refreshes do.  A
        chain placed front-to-back is newest first: decreasing stamps, all
        newer than anything stamped before.  (Runs on every match and insert
        of the SWA/Mamba walks: plain loop, links inlined.)"""
        if not nodes:
            return
        pt = self._pt
        ct = self.component_type
        cache = self.cache
        prev_ref, prev_unref = self.head, self.mid
        clock = self._clock + len(nodes)
        self._clock = clock
        for node in nodes:
            assert node.id in cache
            prevs, nexts = node.lru_prev, node.lru_next
            p, n = prevs[pt], nexts[pt]
            p.lru_next[pt] = n
            n.lru_prev[pt] = p
            if node.component_data[ct].session_ref > 0:
                p = prev_ref
                prev_ref = node
            else:
                p = prev_unref
                prev_unref = node
            n = p.lru_next[pt]
            prevs[pt] = p
            nexts[pt] = n
            n.lru_prev[pt] = node
            p.lru_next[pt] = node
            node.lru_stamp[pt] = clock
            clock -= 1

    def reset_node_and_parents_mru(self, node, root_node, should_include):
        chain = []
        while node is not root_node:
            if should_include(node):
                chain.append(node)
            node = node.parent
        self._refresh_chain(chain)

    def reset_node_and_window_ancestors_mru(
        self, node, root_node, window_size, should_include
    ):
        chain = []
        accumulated = 0
        while node is not root_node and accumulated < window_size:
            if should_include(node):
                chain.append(node)
            accumulated += len(node.key)
            node = node.parent
        self._refresh_chain(chain)

    # ---- partition moves ----

    def move_to_partition(self, node: UnifiedTreeNode) -> None:
        """Move ``node`` into the partition its reference state now calls
        for, at the position its recency stamp gives it (not at the MRU end:
        a just-closed cold session must not jump ahead of warm unreferenced
        KV).  No-op when the node is not listed."""
        if node.id not in self.cache:
            return
        self.moves += 1
        pt = self._pt
        # _remove_node inlined (runs on every reference flip); the links are
        # set again right below.
        prev, nxt = node.lru_prev[pt], node.lru_next[pt]
        prev.lru_next[pt] = nxt
        nxt.lru_prev[pt] = prev
        self._insert_by_stamp(node, node.lru_stamp[pt])

    def _insert_by_stamp(self, node: UnifiedTreeNode, stamp: int) -> None:
        pt = self._pt
        if node.component_data[self.component_type].session_ref > 0:
            start, end = self.head, self.mid
        else:
            start, end = self.mid, self.tail
        # Stamps decrease from start (MRU) to end (LRU); the cursor sentinel
        # may sit inside a partition during an eviction walk and has no stamp.
        first = start.lru_next[pt]
        while first is self.cursor:
            first = first.lru_next[pt]
        if first is end or stamp >= first.lru_stamp[pt]:
            self._add_node_after(start, node)
            return
        last = end.lru_prev[pt]
        while last is self.cursor:
            last = last.lru_prev[pt]
        if stamp <= last.lru_stamp[pt]:
            self._add_node_after(end.lru_prev[pt], node)
            return
        # Search from both ends at once: the cost is twice the distance to the
        # nearer end, in list positions.  Without a walk's cursor linked (it
        # may sit in the gap, and which side of it the node goes depends on
        # the end found first) a long search hands over to the snapshot,
        # which finds the same, unique gap.
        front, back = first, last
        cursor = self.cursor
        steps = _SEARCH_STEPS if cursor.lru_prev[pt] is None else -1
        while True:
            if front is not cursor and front.lru_stamp[pt] < stamp:
                self._add_node_after(front.lru_prev[pt], node)
                break
            if back is not cursor and back.lru_stamp[pt] > stamp:
                self._add_node_after(back, node)
                break
            front = front.lru_next[pt]
            back = back.lru_prev[pt]
            steps -= 1
            if steps == 0:
                anchor = self._anchor(start, end, stamp)
                if anchor is not None:
                    self._add_node_after(anchor, node)
                    return
                # No snapshot, or a stale one: the list search goes on.
        if steps < -_SEARCH_STEPS:
            # A long search: take the snapshot now if the search cost at least
            # a quarter of taking it (so a snapshot is only ever taken after
            # work of its own order), for the next long move.
            snap = self._snapshots.get(start is self.head)
            if snap is None or -steps * 4 >= len(snap[0]):
                self._take_snapshot(start, end)

    # ---- partition snapshots (long moves) ----

    def _take_snapshot(self, start: UnifiedTreeNode, end: UnifiedTreeNode) -> None:
        pt = self._pt
        cursor = self.cursor
        stamps, ids = [], []
        x = end.lru_prev[pt]  # oldest first: stamps ascending
        while x is not start:
            if x is not cursor:
                stamps.append(x.lru_stamp[pt])
                ids.append(x.id)
            x = x.lru_prev[pt]
        self._snapshots[start is self.head] = (stamps, ids)

    def _anchor(self, start, end, stamp: int):
        """The node of the partition (``start``..``end``) after which a node
        stamped ``stamp`` belongs, or None.  From the snapshot: the first
        still-valid node newer than ``stamp``, then the list walked toward
        the LRU end past nodes placed since, up to the gap."""
        referenced = start is self.head
        snap = self._snapshots.get(referenced)
        if snap is None:
            return None
        pt = self._pt
        ct = self.component_type
        cache = self.cache
        stamps, ids = snap
        i = bisect_right(stamps, stamp)
        top = min(len(ids), i + _SEARCH_STEPS)
        anchor = None
        while i < top:
            n = cache.get(ids[i])
            if (n is not None and n.lru_stamp[pt] == stamps[i]
                    and (n.component_data[ct].session_ref > 0) is referenced):
                anchor = n
                break
            i += 1
        if anchor is None:
            return None
        # Nodes placed after the snapshot may sit between the anchor and the
        # gap: walk past the ones still newer than ``stamp``.
        for _ in range(_SEARCH_STEPS):
            nxt = anchor.lru_next[pt]
            if nxt is end or nxt.lru_stamp[pt] < stamp:
                return anchor
            anchor = nxt
        return None

    # ---- cursor ----

    def park_cursor_before(self, node: UnifiedTreeNode) -> None:
        """Link the cursor between ``node`` and its head-side neighbour, so
        the walk can resume from it after ``node`` is unlinked."""
        pt = self._pt
        self.detach_cursor()
        self._add_node_after(node.lru_prev[pt], self.cursor)

    def detach_cursor(self) -> None:
        if self.cursor.lru_prev[self._pt] is not None:
            self._remove_node(self.cursor)

    def next_from_cursor(self, host: bool = False):
        if host:
            return self.get_prev_no_host_lock(self.cursor, check_id=False)
        return self.get_prev_no_lock(self.cursor, check_id=False)

    # ---- checks ----

    def iter_nodes(self):
        pt = self._pt
        x = self.head.lru_next[pt]
        while x is not None and x is not self.tail:
            yield x
            x = x.lru_next[pt]

    def integrity_errors(self, label: str) -> list[str]:
        """Chain, cache and partition invariants as a list of messages."""
        errors = []
        pt = self._pt
        ct = self.component_type
        prev = self.head
        seen = set()
        past_mid = False
        last_stamp, crossed = None, True
        x = self.head.lru_next[pt]
        while x is not None and x is not self.tail:
            if x.lru_prev[pt] is not prev:
                errors.append(f"[{label}][{ct}] broken prev link at node {x.id}")
            if x is self.mid:
                if past_mid:
                    errors.append(f"[{label}][{ct}] mid sentinel seen twice")
                past_mid = True
                crossed = True  # recency restarts in the other partition
            elif x is self.cursor:
                errors.append(f"[{label}][{ct}] cursor left linked after a walk")
            else:
                if x.id not in self.cache:
                    errors.append(f"[{label}][{ct}] node {x.id} linked but not cached")
                if x.id in seen:
                    errors.append(f"[{label}][{ct}] cycle at node {x.id}")
                    break
                seen.add(x.id)
                stamps = x.lru_stamp
                stamp = stamps[pt] if stamps is not None else None
                if stamp is None:
                    errors.append(f"[{label}][{ct}] node {x.id} has no recency stamp")
                elif last_stamp is not None and stamp >= last_stamp and not crossed:
                    errors.append(
                        f"[{label}][{ct}] node {x.id} is out of recency order "
                        f"({stamp} after {last_stamp})"
                    )
                last_stamp, crossed = stamp, False
                if self.is_referenced(x) == past_mid:
                    side = "unreferenced" if past_mid else "referenced"
                    errors.append(
                        f"[{label}][{ct}] node {x.id} sits in the {side} partition "
                        f"with session_ref={x.component_data[ct].session_ref}"
                    )
            prev = x
            x = x.lru_next[pt]
        if x is None:
            errors.append(f"[{label}][{ct}] chain ends without reaching tail")
        if not past_mid:
            errors.append(f"[{label}][{ct}] mid sentinel missing")
        if len(seen) != len(self.cache):
            errors.append(
                f"[{label}][{ct}] list holds {len(seen)} nodes, cache {len(self.cache)}"
            )
        return errors
