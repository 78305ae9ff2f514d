"""Per-component session reference accounting on the unified radix tree.

Every tree component keeps its own view of which nodes a session still wants:

* FULL  — the whole reusable path from a session leaf up to the root.
* SWA   — only the tail of that path that covers the sliding window plus one
          page of alignment allowance.
* Mamba — only the state on the leaf itself.

The source of truth is the per-session leaf index (``leaves``: session id ->
set of leaf nodes).  Nodes carry **counts only**, never per-session sets, so a
node split costs the same whether one session or thousands share the node
(``ComponentData`` gains three fields, see ``patches/unified_cache.py``):

* ``session_ref``     FULL: number of distinct sessions whose path covers the
                      node (what the eviction heap orders by).  SWA/Mamba:
                      number of leaf references covering it (eviction only
                      asks whether it is non-zero).
* ``session_below``   SWA only: ``{tokens strictly below the node on the
                      covering leaf's path: number of leaf references}``.  A
                      split derives the new upper node from it in
                      O(window) — a leaf covers the upper part iff its
                      distance plus the lower part's length is still inside
                      the window.
* ``session_leaf_of`` the sessions that hold this node as a leaf (reverse of
                      the leaf index), used when the node goes away.

Costs: a split is O(1) for FULL and Mamba and O(distinct distances) <=
O(window) for SWA.  A close walks each covered FULL node once (the union of
the session's paths, not leaves x depth), each SWA window once per leaf and
each Mamba leaf once.

Coverage rules are structural (they look at keys and parents, not at whether
device memory is present), so evicting a component's data in place never
changes a count.  Counts change only on register/release, on node splits and
when a referenced leaf loses its data (its reference moves to the nearest
reusable ancestor).  When eviction deletes a session leaf, the counts of all
its references move at once (see "hand-over of deleted leaves" below); only
the index entries move one by one.  ``validate`` recomputes everything from
the index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from sglang.srt.mem_cache.unified_cache_components import TreeComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode


def _ignore(node, ct) -> None:
    return None


def key_length(key) -> int:
    """``len(key)`` for a node's ``RadixKey``.  ``RadixKey.__len__`` is two
    Python-level calls; the eviction hooks ask on every deleted session leaf,
    and a tree key is almost always a plain one (no limit, not bigram)."""
    if key.limit is None and not key.is_bigram:
        return len(key.token_ids)
    return len(key)


class SessionStateError(AssertionError):
    """Raised by the validator when stored counts disagree with the leaf index."""


class ComponentSessionRefs(ABC):
    """Session reference counts for one tree component.

    ``on_ref_change(node, component_type)`` is called whenever a node's
    ``session_ref`` flips between zero and non-zero, so eviction structures can
    move the node between their referenced and unreferenced partitions.

    The base class counts **leaf references** (SWA, Mamba): each leaf of each
    session adds one to every node it covers, independently of other leaves.
    FULL overrides the operations to count distinct sessions on the path.
    """

    #: Whether losing this component's device data on a session leaf (without
    #: deleting the node) moves the reference to an ancestor.
    relocate_on_device_evict = False
    #: FULL mirrors its count onto the node itself (``node.full_session_ref``):
    #: the eviction heap reads it for every evictable leaf, and a field on the
    #: node costs no extra memory hop where ``component_data[0]`` costs two.
    mirror_on_node = False
    notify_ref_change = True
    #: Set by ``follow``: the refs whose leaf index this one reads instead of
    #: keeping its own.
    index_owner: Optional["ComponentSessionRefs"] = None

    def __init__(
        self,
        component: TreeComponent,
        on_ref_change: Callable[[UnifiedTreeNode, int], None],
    ):
        self.component = component
        self.ct = component.component_type
        self.cache = component.cache
        # FULL is ordered by the leaf heap, which reads counts at eviction
        # time; only LRU-driven components need to hear about flips.
        self._on_ref_change = on_ref_change if self.notify_ref_change else _ignore
        # Per-session leaf index: session_id -> set of leaf nodes.
        # Each leaf maps to (stamp, arrived): the tracker event numbers of its
        # newest registration and of that request's arrival (0: unknown);
        # "registered before a request arrived" is decided on them.
        self.leaves: dict[str, dict] = {}
        # Components that share this index (``follow``); told of every
        # reference this one adds, drops or moves, they keep only counts.
        self.followers: tuple = ()
        # Data under a reference, counted once per node (tokens; Mamba:
        # states), kept on every 0 <-> non-zero flip so the protection bound
        # (protection_policy.py) reads it in O(1).
        self.ref_units = 0
        # Nodes whose mirrored count went down since FULL's kept leaf heap
        # last looked (``full_leaf_heap``): their heap keys are too high.
        # Drained by every eviction call (a node deleted meanwhile is let go
        # there, not on every deletion: that path is hot).
        self.lowered: set = set()

    def follow(self, owner: "ComponentSessionRefs") -> None:
        """Share ``owner``'s leaf index instead of keeping an identical one
        (SWA follows FULL: both reference exactly the session leaves, and a
        deleted leaf's references move to the same ancestor for both, since
        both take the nearest one still holding FULL KV).  One index means
        one set of entries to move per deleted leaf, and half the memory.
        Changes go through ``owner``, which applies them here as counts."""
        if self.leaves or self.ref_units:
            raise RuntimeError("follow() needs a component without references")
        self.index_owner = owner
        self.leaves = owner.leaves
        owner.followers += (self,)

    def _reject_follower_change(self) -> None:
        raise RuntimeError(
            f"component {self.ct} shares the leaf index of component "
            f"{self.index_owner.ct}; change references through that one"
        )

    def units(self, node: UnifiedTreeNode) -> int:
        """What a referenced ``node`` counts toward ``ref_units``."""
        return key_length(node.key)

    # ---- hand-over of deleted leaves ----
    #
    # When eviction deletes a session leaf whose parent still holds KV (the
    # common case), each component moves the counts of all the leaf's
    # references at once -- FULL: only the leaf's own count (the parent's
    # path is the same path); SWA: one walk over the parent's window; Mamba,
    # with no ancestor state: the leaf cleared -- and then moves each
    # session's index entry in one tight loop, with no per-session walk.
    # The deleted node is freed with the eviction, and the index never
    # points at a node outside the tree.  (Leaving the entries on the deleted
    # node until the session was next touched measured worse once idle
    # sessions piled up: resolving them later walked the tree again and freed
    # their nodes cold.)

    def leaves_of(self, sid: str) -> dict:
        """``sid``'s leaf index (``{leaf: (stamp, arrived)}``)."""
        return self.leaves.get(sid) or {}

    def _hand_over_to_parent(self, node: UnifiedTreeNode, parent: UnifiedTreeNode,
                             sids: set) -> int:
        """Reverse entries of the deleted ``node`` to its parent (one union),
        then each session's index entry; returns how many sessions already
        held the parent (their two references are now one: the caller,
        having moved the counts, takes the extra cover back)."""
        ct = self.ct
        pcd = parent.component_data[ct]
        node.component_data[ct].session_leaf_of = None
        if pcd.session_leaf_of is None:
            pcd.session_leaf_of = sids  # the deleted node's set, reused
        else:
            pcd.session_leaf_of |= sids
        merged = 0
        leaves = self.leaves
        for sid in sids:
            idx = leaves[sid]
            turn = idx.pop(node)
            old = idx.get(parent)
            if old is None:
                idx[parent] = turn
            else:  # a leaf reached twice keeps its newest registration
                merged += 1
                if turn > old:
                    idx[parent] = turn
        return merged

    def hand_over_deleted(self, node: UnifiedTreeNode, parent: UnifiedTreeNode,
                          sids: set, length: int) -> None:
        """Eviction deleted the session leaf ``node`` (``length`` tokens),
        whose ``parent`` holds KV: its references (``sids``) go to the parent
        together.  Components override; by default the general route."""
        self.discard_deleted_session_leaf(node)

    # ---- the rule each component defines ----

    @abstractmethod
    def covered(self, leaf: UnifiedTreeNode) -> list:
        """Nodes a reference on ``leaf`` protects for this component."""

    def reusable(self, node: UnifiedTreeNode) -> bool:
        """Whether ``node`` can hold a reference moved up from a deleted leaf."""
        return True

    # ---- leaf-reference counting (SWA and Mamba override the cover) ----

    def _add_cover(self, leaf: UnifiedTreeNode) -> None:
        for n in self.covered(leaf):
            self._bump(n, 1)

    def _remove_cover(self, leaf: UnifiedTreeNode, skip_leaf: bool = False) -> None:
        cover = self.covered(leaf)
        for n in cover[1:] if skip_leaf else cover:  # covered() starts at the leaf
            self._bump(n, -1)

    def _bump(self, node: UnifiedTreeNode, delta: int) -> None:
        cd = node.component_data[self.ct]
        old = cd.session_ref
        ref = old + delta
        cd.session_ref = ref
        if self.mirror_on_node:
            node.full_session_ref = ref
            if delta < 0:
                self.lowered.add(node)
        if ref == 0:
            self.ref_units -= self.units(node)
        elif old == 0:
            self.ref_units += self.units(node)
        if ref == 0 or old == 0:  # flipped (delta is never 0)
            self._on_ref_change(node, self.ct)

    def _clear_node(self, node: UnifiedTreeNode) -> None:
        """Drop a deleted node's counts wholesale (no partition move: it is
        already off every list)."""
        cd = node.component_data[self.ct]
        if cd.session_ref:
            self.ref_units -= self.units(node)
        cd.session_ref = 0
        if self.mirror_on_node:
            node.full_session_ref = 0

    # ---- leaf index ----

    def _index_leaf(self, sid: str, leaf: UnifiedTreeNode) -> None:
        self.leaves.setdefault(sid, {}).setdefault(leaf, (0, 0))
        cd = leaf.component_data[self.ct]
        if cd.session_leaf_of is None:
            cd.session_leaf_of = set()
        cd.session_leaf_of.add(sid)

    def _unindex_leaf(self, sid: str, leaf: UnifiedTreeNode) -> None:
        idx = self.leaves.get(sid)
        if idx is not None:
            idx.pop(leaf, None)
            if not idx:
                del self.leaves[sid]
        self._drop_reverse(sid, leaf)

    def _drop_reverse(self, sid: str, leaf: UnifiedTreeNode) -> None:
        cd = leaf.component_data[self.ct]
        if cd.session_leaf_of is not None:
            cd.session_leaf_of.discard(sid)
            if not cd.session_leaf_of:
                cd.session_leaf_of = None

    def _indexed_ancestors(self, idx, leaf: UnifiedTreeNode) -> list:
        """Leaves in ``idx`` that are strict ancestors of ``leaf``."""
        root = self.cache.root_node
        out = []
        cur = leaf.parent
        while cur is not None and cur is not root:
            if cur in idx:
                out.append(cur)
            cur = cur.parent
        return out

    # ---- public operations ----

    def register_session_leaf(
        self,
        sid: str,
        leaf: UnifiedTreeNode,
        stamp: int = 0,
        supersede_before: Optional[int] = None,
    ) -> bool:
        """Reference ``leaf`` for ``sid`` (``stamp``: this registration's
        event number).  The reference follows the session's newest turn:

        * older leaves of the session that are ancestors of ``leaf`` are
          subsumed (their references go);
        * with ``supersede_before`` (the registering request's arrival
          number), every other leaf whose newest registration happened before
          that arrival is dropped too: the request could build on it, so it is
          an older turn or a branch the session moved away from.  Leaves
          registered after the request arrived belong to requests that ran
          concurrently and are kept.
        """
        if self.index_owner is not None:
            self._reject_follower_change()
        added = self._register(sid, leaf)
        idx = self.leaves[sid]
        if not added and len(idx) > 1:
            # Re-registered: an older leaf may have been registered above it
            # meanwhile; it is subsumed like on a first registration.
            for old in self._indexed_ancestors(idx, leaf):
                self.drop_session_leaf(sid, old)
        idx[leaf] = max((stamp, supersede_before or 0), idx[leaf])
        if supersede_before is not None and len(idx) > 1:
            stale = [n for n, t in idx.items() if t[0] < supersede_before and n is not leaf]
            for old in stale:
                self.drop_session_leaf(sid, old)
        return added

    def _register(self, sid: str, leaf: UnifiedTreeNode) -> bool:
        """Index ``leaf`` for ``sid`` and subsume its ancestor leaves; False
        when it was indexed already (nothing changed)."""
        idx = self.leaves.get(sid)
        if idx is not None and leaf in idx:
            return False
        subsumed = self._indexed_ancestors(idx, leaf) if idx else ()
        # Add before removing so nodes in both covers never touch zero (no
        # spurious partition moves).
        self._add_cover(leaf)
        for old in subsumed:
            self._remove_cover(old)
            self._unindex_leaf(sid, old)
        self._index_leaf(sid, leaf)
        return True

    def release_session(self, sid: str) -> int:
        """Drop every reference ``sid`` holds on this component."""
        if self.index_owner is not None:
            self._reject_follower_change()
        leaves = self.leaves.pop(sid, None)
        if not leaves:
            return 0
        for leaf in leaves:
            self._remove_cover(leaf)
            self._drop_reverse(sid, leaf)
        return len(leaves)

    def drop_session_leaf(self, sid: str, leaf: UnifiedTreeNode) -> bool:
        """Drop one leaf reference of ``sid`` (the session's other leaves keep
        theirs).  Returns whether ``leaf`` was referenced by ``sid``."""
        if self.index_owner is not None:
            self._reject_follower_change()
        idx = self.leaves.get(sid)
        if not idx or leaf not in idx:
            return False
        self._unindex_leaf(sid, leaf)
        self._remove_cover(leaf)
        return True

    def discard_deleted_session_leaf(
        self, node: UnifiedTreeNode, node_deleted: bool = True
    ) -> None:
        """``node`` is losing this component: it is being deleted from the
        tree, or (``node_deleted=False``, relocating components only) its
        state was evicted in place.  The general route (a deleted leaf whose
        parent holds KV takes ``hand_over_deleted`` instead, chosen by the
        tracker): each session holding it as a leaf moves its reference to
        the nearest reusable ancestor; a session whose walk reaches the root
        simply loses that leaf.

        A deleted node is a childless leaf, so only its own sessions cover it:
        its counts are dropped wholesale instead of one by one."""
        ct = self.ct
        cd = node.component_data[ct]
        sids = cd.session_leaf_of
        if not sids:
            return
        # Wholesale drop relies on nothing below covering the node.
        node_deleted = node_deleted and not node.children
        parent = node.parent
        if parent is not self.cache.root_node and parent is not None and self.reusable(parent):
            target = parent  # the common case, without the walk
        else:
            target = self._nearest_reusable_ancestor(node)
        cd.session_leaf_of = None
        leaves = self.leaves
        followers = self.followers
        for sid in sids:
            idx = leaves[sid]
            turn = idx.pop(node)
            fresh = False
            if target is not None:
                # A leaf reached twice keeps its newest registration.
                old = idx.get(target)
                if old is None:
                    fresh = True
                    idx[target] = turn
                    tcd = target.component_data[ct]
                    if tcd.session_leaf_of is None:
                        tcd.session_leaf_of = {sid}
                    else:
                        tcd.session_leaf_of.add(sid)
                elif turn > old:
                    idx[target] = turn
            moved_to = target if fresh else None
            self._move_cover(sid, node, moved_to, node_deleted)
            for f in followers:
                f._move_cover(sid, node, moved_to, node_deleted)
            if not idx:
                del leaves[sid]
        if node_deleted:
            self._clear_node(node)
            for f in followers:
                f._clear_node(node)

    def _move_cover(self, sid, node, target, node_deleted) -> None:
        """Counts for ``sid``'s leaf moving from ``node`` to ``target`` (None:
        the reference is just dropped).  The index is already updated."""
        if target is not None:
            self._add_cover(target)
        self._remove_cover(node, skip_leaf=node_deleted)

    def _nearest_reusable_ancestor(self, node: UnifiedTreeNode):
        root = self.cache.root_node
        cur = node.parent
        while cur is not None and cur is not root:
            if self.reusable(cur):
                return cur
            cur = cur.parent
        return None

    def account_split(self, new_parent: UnifiedTreeNode, child: UnifiedTreeNode) -> None:
        """After ``on_split``: ``ref_units`` for the upper part that moved from
        ``child`` (still counted with it) to ``new_parent`` (counted only if
        ``on_split`` gave it a reference, which it sets without ``_bump``)."""
        if child.component_data[self.ct].session_ref:
            self.ref_units -= self.units(new_parent)
        if new_parent.component_data[self.ct].session_ref:
            self.ref_units += self.units(new_parent)

    @abstractmethod
    def on_split(self, new_parent: UnifiedTreeNode, child: UnifiedTreeNode) -> None:
        """``child`` was split; ``new_parent`` holds its upper part (leaves
        keep pointing at ``child``, the lower end).  Give ``new_parent`` its
        counts without looking at sessions or leaves."""

    # ---- checks ----

    def coverage(self) -> dict:
        """``{node: {sid: number of sid's leaves covering node}}``, recomputed
        from the leaf index (for the validator and tests; O(leaves x cover))."""
        out: dict = {}
        for sid, leaves in self.leaves.items():
            for leaf in leaves:
                for n in self.covered(leaf):
                    per = out.setdefault(n, {})
                    per[sid] = per.get(sid, 0) + 1
        return out

    def _expected_ref(self, per_session: dict) -> int:
        """The stored ``session_ref`` implied by ``{sid: multiplicity}``."""
        return sum(per_session.values())

    def _check_node_extra(self, node, name: str) -> Optional[str]:
        """Component-specific stored state to check (SWA's distances)."""
        return None

    def validate(self, nodes: list) -> None:
        name = str(self.ct)
        root = self.cache.root_node
        in_tree = {n.id for n in nodes}
        # The reverse entries live with the index (its owner's when following).
        index_ct = (self.index_owner or self).ct
        for sid, leaves in self.leaves.items():
            if not leaves:
                raise SessionStateError(f"[{name}] empty leaf set kept for {sid!r}")
            for leaf in leaves:
                if leaf is root:
                    raise SessionStateError(f"[{name}] root registered for {sid!r}")
                if leaf.id not in in_tree:
                    raise SessionStateError(
                        f"[{name}] session {sid!r} references node {leaf.id} "
                        "which is no longer in the tree"
                    )
                sids = leaf.component_data[index_ct].session_leaf_of
                if not sids or sid not in sids:
                    raise SessionStateError(
                        f"[{name}] node {leaf.id} is in {sid!r}'s leaf index "
                        "but lacks the reverse entry"
                    )
            # Newest-turn rule: a registration drops every leaf registered
            # before its request arrived, so no kept leaf predates the
            # arrival of any kept leaf's request.
            oldest = min(t[0] for t in leaves.values())
            newest_arrival = max(t[1] for t in leaves.values())
            if oldest < newest_arrival:
                raise SessionStateError(
                    f"[{name}] session {sid!r} keeps a leaf registered at {oldest}, "
                    f"before a newer turn arrived at {newest_arrival}"
                )
        coverage = self.coverage()
        for n in coverage:
            if n.id not in in_tree:
                raise SessionStateError(
                    f"[{name}] node {n.id} is covered by "
                    f"{sorted(coverage[n])} but is not in the tree"
                )
        units = sum(
            self.units(n) for n in nodes if n.component_data[self.ct].session_ref
        )
        if units != self.ref_units:
            raise SessionStateError(
                f"[{name}] ref_units={self.ref_units} but referenced nodes hold {units}"
            )
        for n in nodes:
            cd = n.component_data[self.ct]
            want = self._expected_ref(coverage.get(n, {}))
            if cd.session_ref != want:
                raise SessionStateError(
                    f"[{name}] node {n.id}: session_ref={cd.session_ref}, leaf "
                    f"index implies {want} ({coverage.get(n, {})})"
                )
            if self.mirror_on_node and n.full_session_ref != cd.session_ref:
                raise SessionStateError(
                    f"[{name}] node {n.id}: node mirror {n.full_session_ref} != "
                    f"component count {cd.session_ref}"
                )
            problem = self._check_node_extra(n, name)
            if problem:
                raise SessionStateError(problem)
            if self.index_owner is not None and cd.session_leaf_of is not None:
                raise SessionStateError(
                    f"[{name}] node {n.id} has its own reverse entries, but the "
                    "component shares another's leaf index"
                )
            for sid in cd.session_leaf_of or ():
                if n not in self.leaves.get(sid, ()):
                    raise SessionStateError(
                        f"[{name}] node {n.id} claims to be a leaf of {sid!r} "
                        "but the index disagrees"
                    )

    def referenced_nodes(self) -> set:
        """Nodes some session leaf covers for this component."""
        seen: set = set()
        for leaves in self.leaves.values():
            for leaf in leaves:
                seen.update(self.covered(leaf))
        return seen

    def referenced_tokens(self) -> int:
        """Device data of this component held under a reference (tokens;
        states for Mamba)."""
        total = 0
        for n in self.referenced_nodes():
            value = n.component_data[self.ct].value
            if value is not None:
                total += len(value)
        return total


class FullSessionRefs(ComponentSessionRefs):
    """FULL: every node from the leaf to the root is needed to reuse it.

    A session covers a node iff one of its leaves lies in the node's subtree,
    so the count is the number of distinct such sessions.  Registering and
    dropping a leaf touch only the part of its path no other leaf of the same
    session covers (found by walking the session's other leaves up to where
    they meet the path); a split copies the count, since the new upper node
    has exactly the lower node's subtree.  A deleted leaf handed to its
    parent changes no count but its own (the parent's path is the same
    path)."""

    mirror_on_node = True
    notify_ref_change = False

    def covered(self, leaf):
        root = self.cache.root_node
        out = []
        cur = leaf
        while cur is not None and cur is not root:
            out.append(cur)
            cur = cur.parent
        return out

    def reusable(self, node):
        cd = node.component_data[self.ct]
        return cd.value is not None or cd.host_value is not None

    def _lowest_shared(self, idx, path: list, skip=None) -> int:
        """Index in ``path`` (a node's path up to the root, node first) of the
        lowest node that a leaf in ``idx`` (other than ``skip``) also covers;
        ``len(path)`` when none does.  Each node is walked at most once."""
        best = len(path)
        if not idx:
            return best
        pos = {n: i for i, n in enumerate(path)}
        root = self.cache.root_node
        seen: set = set()
        for other in idx:
            if other is skip:
                continue
            cur = other
            while cur is not None and cur is not root:
                i = pos.get(cur)
                if i is not None:
                    if i < best:
                        best = i
                    break
                if cur in seen:
                    break
                seen.add(cur)
                cur = cur.parent
        return best

    def _register(self, sid, leaf):
        idx = self.leaves.get(sid)
        if idx is not None and leaf in idx:
            return False
        root = self.cache.root_node
        path = []
        cur = leaf
        while cur is not None and cur is not root and not (idx and cur in idx):
            path.append(cur)
            cur = cur.parent
        new = len(path)  # nodes below the nearest older leaf on the path
        if idx and (cur is root or cur is None or len(idx) > 1):
            # Other branches of the session may already cover part of the
            # path: complete it to the root and find where they meet it.
            while cur is not None and cur is not root:
                path.append(cur)
                cur = cur.parent
            new = min(new, self._lowest_shared(idx, path))
        for n in path[:new]:
            self._bump(n, 1)
        subsumed = []
        if idx:
            # Older leaves on the path are subsumed (the new leaf covers them).
            for old in path[new:] if len(path) > new else ():
                if old in idx:
                    subsumed.append(old)
            if cur is not None and cur is not root and cur in idx:
                subsumed.append(cur)  # the nearest older leaf (fast path)
            for old in subsumed:
                self._unindex_leaf(sid, old)
        self._index_leaf(sid, leaf)
        for f in self.followers:
            # Add before removing, as a component with its own index does.
            f._add_cover(leaf)
            for old in subsumed:
                f._remove_cover(old)
        return True

    def release_session(self, sid):
        leaves = self.leaves.pop(sid, None)
        if not leaves:
            return 0
        # The union of the leaves' paths, each node once.
        root = self.cache.root_node
        seen: set = set()
        for leaf in leaves:
            cur = leaf
            while cur is not None and cur is not root and cur not in seen:
                seen.add(cur)
                self._bump(cur, -1)
                cur = cur.parent
            self._drop_reverse(sid, leaf)
        for f in self.followers:
            for leaf in leaves:
                f._remove_cover(leaf)
        # Counted per component, as when each kept its own index.
        return len(leaves) * (1 + len(self.followers))

    def drop_session_leaf(self, sid, leaf):
        idx = self.leaves.get(sid)
        if not idx or leaf not in idx:
            return False
        self._unindex_leaf(sid, leaf)
        path = self.covered(leaf)
        for n in path[: self._lowest_shared(self.leaves.get(sid), path)]:
            self._bump(n, -1)
        for f in self.followers:
            f._remove_cover(leaf)
        return True

    def hand_over_deleted(self, node, parent, sids, length):
        # Only the leaf's own count changes (the parent's path is the same
        # path); a session that already held the parent counted it once, so
        # there is nothing to take back (FULL counts distinct sessions).
        merged = self._hand_over_to_parent(node, parent, sids)
        cd = node.component_data[0]
        if cd.session_ref:
            self.ref_units -= length
        cd.session_ref = 0
        node.full_session_ref = 0
        for f in self.followers:
            f.hand_over_counts(node, parent, merged, length)

    def _move_cover(self, sid, node, target, node_deleted):
        # ``target`` (when given) is an ancestor already in the index, so the
        # shared-path search sees it and stops there.  (A deleted leaf handed
        # to its parent never gets here: that is the bulk hand-over.)
        path = self.covered(node)
        start = 1 if node_deleted else 0
        for n in path[start: self._lowest_shared(self.leaves.get(sid), path)]:
            self._bump(n, -1)

    def on_split(self, new_parent, child):
        # The new upper node has exactly the lower node's subtree.
        ref = child.component_data[self.ct].session_ref
        if ref:
            new_parent.component_data[self.ct].session_ref = ref
            new_parent.full_session_ref = ref

    def _expected_ref(self, per_session):
        return len(per_session)  # distinct sessions

    def referenced_nodes(self) -> set:
        # Path rule: a node already seen has all its ancestors seen too.
        root = self.cache.root_node
        seen: set = set()
        for leaves in self.leaves.values():
            for leaf in leaves:
                cur = leaf
                while cur is not None and cur is not root and cur not in seen:
                    seen.add(cur)
                    cur = cur.parent
        return seen


class SWASessionRefs(ComponentSessionRefs):
    """SWA: only the tail within ``sliding_window_size + page_size`` tokens of
    the leaf end.  A node counts when the tokens strictly below it on the path
    are fewer than that bound, so a window straddling a node takes the whole
    node (page allowance) and never more.  Each node keeps how many covering
    leaf references sit at each distance (``session_below``), which is all a
    split needs."""

    def __init__(self, component, on_ref_change):
        super().__init__(component, on_ref_change)
        self.window = component.sliding_window_size + self.cache.page_size

    def _window(self, leaf):
        """``(node, tokens strictly below it)`` for the nodes ``leaf`` covers."""
        root = self.cache.root_node
        out = []
        acc = 0
        cur = leaf
        window = self.window
        while cur is not None and cur is not root and acc < window:
            out.append((cur, acc))
            acc += key_length(cur.key)
            cur = cur.parent
        return out

    def covered(self, leaf):
        return [n for n, _ in self._window(leaf)]

    def _at(self, node, below: int, delta: int) -> None:
        cd = node.component_data[self.ct]
        hist = cd.session_below
        if hist is None:
            hist = cd.session_below = {}
        c = hist.get(below, 0) + delta
        if c:
            hist[below] = c
        else:
            del hist[below]
            if not hist:
                cd.session_below = None
        self._bump(node, delta)

    def _add_cover(self, leaf):
        for n, below in self._window(leaf):
            self._at(n, below, 1)

    def _remove_cover(self, leaf, skip_leaf=False):
        win = self._window(leaf)
        for n, below in win[1:] if skip_leaf else win:
            self._at(n, below, -1)

    def _clear_node(self, node):
        node.component_data[self.ct].session_below = None
        super()._clear_node(node)

    def hand_over_deleted(self, node, parent, sids, length):
        merged = self._hand_over_to_parent(node, parent, sids)
        self.hand_over_counts(node, parent, merged, length)

    def hand_over_counts(self, node, parent, merged, length):
        """The counts of a deleted leaf's references moving to ``parent``
        (the index already moved; ``merged`` of them met one there).  The
        leaf's references (all at distance 0: it has no children) move
        together, in one walk: nodes the old windows reached only move to a
        nearer distance (no count change); nodes newly in reach gain them."""
        ct = self.ct
        cd = node.component_data[ct]
        hist = cd.session_below
        moved = hist.get(0, 0) if hist else 0
        root = self.cache.root_node
        window = self.window
        shift = length
        acc = 0
        cur = parent
        while moved:
            old = acc + shift
            if old < window:
                h = cur.component_data[ct].session_below
                left = h[old] - moved
                if left:
                    h[old] = left
                else:
                    del h[old]
                h[acc] = h.get(acc, 0) + moved
            else:
                self._at(cur, acc, moved)
            nxt = cur.parent
            if nxt is None or nxt is root:
                break
            acc += key_length(cur.key)  # only when the walk goes on
            if acc >= window:
                break
            cur = nxt
        # Counts dropped wholesale (what _clear_node does, its length known).
        if cd.session_ref:
            self.ref_units -= shift
        cd.session_ref = 0
        cd.session_below = None
        if merged:  # sessions that held the parent too: one cover each back
            for n, below in self._window(parent):
                self._at(n, below, -merged)

    def on_split(self, new_parent, child):
        hist = child.component_data[self.ct].session_below
        if not hist:
            return
        # A leaf at distance d below ``child`` is d + len(child) below the new
        # upper part; it covers it while that is still inside the window.
        extra = len(child.key)
        window = self.window
        up = {d + extra: c for d, c in hist.items() if d + extra < window}
        if up:
            cd = new_parent.component_data[self.ct]
            cd.session_below = up
            cd.session_ref = sum(up.values())
            self._on_ref_change(new_parent, self.ct)

    def reusable(self, node):
        cd = node.component_data[0]  # structural: any node still holding FULL
        return cd.value is not None or cd.host_value is not None

    def _check_node_extra(self, node, name):
        want: dict = {}
        for sid, leaves in self._leaves_by_node().get(node, {}).items():
            for below in leaves:
                want[below] = want.get(below, 0) + 1
        have = node.component_data[self.ct].session_below or {}
        if have != want:
            return (f"[{name}] node {node.id}: distances {have}, leaf index "
                    f"implies {want}")
        return None

    def _leaves_by_node(self):
        # Recomputed once per validate() call (cached on the call's identity).
        cache = self.__dict__.get("_validate_cache")
        if cache is None:
            cache = {}
            for sid, leaves in self.leaves.items():
                for leaf in leaves:
                    for n, below in self._window(leaf):
                        cache.setdefault(n, {}).setdefault(sid, []).append(below)
            self._validate_cache = cache
        return cache

    def validate(self, nodes):
        self._validate_cache = None
        try:
            super().validate(nodes)
        finally:
            self._validate_cache = None


class MambaSessionRefs(ComponentSessionRefs):
    """Mamba: the state on the leaf only; when it is evicted the reference
    moves to the nearest ancestor that still has a state."""

    relocate_on_device_evict = True

    def covered(self, leaf):
        return [leaf]

    def units(self, node):
        return 1  # one state per referenced node

    def discard_deleted_session_leaf(self, node, node_deleted=True):
        sids = node.component_data[self.ct].session_leaf_of
        if not sids:
            return
        if self._nearest_reusable_ancestor(node) is not None:
            return super().discard_deleted_session_leaf(node, node_deleted)
        self._drop_all(node, sids, node_deleted and not node.children)

    def hand_over_deleted(self, node, parent, sids, length):
        # The parent holds KV, but a Mamba reference needs a state: look for
        # the nearest ancestor with one from the parent up (the walk of
        # ``_nearest_reusable_ancestor``, inlined: this runs on every
        # eviction of a referenced leaf).
        ct = self.ct
        root = self.cache.root_node
        cur = parent
        while cur is not root and cur is not None:
            cd = cur.component_data[ct]
            if cd.value is not None or cd.host_value is not None:
                return super().discard_deleted_session_leaf(node)
            cur = cur.parent
        self._drop_all(node, sids, True)

    def _drop_all(self, node, sids, deleted: bool) -> None:
        # The eviction case: no ancestor holds a state (SGLang keeps them
        # where inserts ended), so every reference on the node just goes --
        # its count drops to zero in one step.
        cd = node.component_data[self.ct]
        cd.session_leaf_of = None
        leaves = self.leaves
        for sid in sids:
            idx = leaves[sid]
            del idx[node]
            if not idx:
                del leaves[sid]
        if deleted:
            if cd.session_ref:  # _clear_node, inlined: off every list already
                self.ref_units -= 1
                cd.session_ref = 0
            return
        self._bump(node, -len(sids))

    def _nearest_reusable_ancestor(self, node):
        # ``reusable`` inlined: runs on every eviction of a referenced leaf.
        ct = self.ct
        root = self.cache.root_node
        cur = node.parent
        while cur is not None and cur is not root:
            cd = cur.component_data[ct]
            if cd.value is not None or cd.host_value is not None:
                return cur
            cur = cur.parent
        return None

    def account_split(self, new_parent, child):
        return  # the child keeps its state; the new upper node has none

    def on_split(self, new_parent, child):
        # States live on leaves; the new upper node never holds a reference.
        return

    def reusable(self, node):
        cd = node.component_data[self.ct]
        return cd.value is not None or cd.host_value is not None


REFS_BY_COMPONENT = {0: FullSessionRefs, 1: SWASessionRefs, 2: MambaSessionRefs}


def index_owners(components: dict) -> tuple:
    """The refs keeping a leaf index (followers change with their owner):
    the ones references are registered, dropped and released through."""
    return tuple(refs for refs in components.values() if refs.index_owner is None)


def make_component_refs(component, on_ref_change) -> Optional[ComponentSessionRefs]:
    cls = REFS_BY_COMPONENT.get(int(component.component_type))
    return cls(component, on_ref_change) if cls is not None else None
