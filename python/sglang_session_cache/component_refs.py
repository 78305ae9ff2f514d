"""Per-component session reference accounting on the unified radix tree.

Every tree component keeps its own view of which nodes a session still wants:

* FULL  — the whole reusable path from a session leaf up to the root.
* SWA   — only the tail of that path that covers the sliding window plus one
          page of alignment allowance.
* Mamba — only the state on the leaf itself.

State lives on the component data of each node (``ComponentData`` gains three
fields, see ``patches/unified_cache.py``):

* ``session_ids``     ``{session_id: multiplicity}`` — how many of that
                      session's leaves cover the node; ``None`` when empty.
* ``session_ref``     number of distinct sessions covering the node.  This is
                      what eviction reads, so one session is counted once no
                      matter how many of its windows overlap the node.
* ``session_leaf_of`` the sessions that hold this node as a leaf (reverse of the
                      per-session leaf index), used when the node goes away.

Coverage rules are structural (they look at keys and parents, not at whether
device memory is present), so evicting a component's data in place never
changes a count.  Counts change only on register/release, on node splits and
when a referenced leaf is deleted (its reference moves to the nearest reusable
ancestor).  ``validate`` recomputes everything from the leaf index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    from sglang.srt.mem_cache.unified_cache_components import TreeComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode


def _ignore(node, ct) -> None:
    return None


class SessionStateError(AssertionError):
    """Raised by the validator when stored counts disagree with the leaf index."""


class ComponentSessionRefs(ABC):
    """Session reference counts for one tree component.

    ``on_ref_change(node, component_type)`` is called whenever a node's
    ``session_ref`` flips between zero and non-zero, so eviction structures can
    move the node between their referenced and unreferenced partitions.
    """

    #: Whether losing this component's device data on a session leaf (without
    #: deleting the node) moves the reference to an ancestor.
    relocate_on_device_evict = False
    #: FULL mirrors its count onto the node itself (``node.full_session_ref``):
    #: the eviction heap reads it for every evictable leaf, and a field on the
    #: node costs no extra memory hop where ``component_data[0]`` costs two.
    mirror_on_node = False
    notify_ref_change = True

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
        self.leaves: dict[str, set] = {}

    # ---- the one rule each component defines ----

    @abstractmethod
    def covered(self, leaf: UnifiedTreeNode) -> list:
        """Nodes a reference on ``leaf`` protects for this component."""

    def reusable(self, node: UnifiedTreeNode) -> bool:
        """Whether ``node`` can hold a reference moved up from a deleted leaf."""
        return True

    # ---- counting primitives ----

    def _inc(self, node: UnifiedTreeNode, sid: str) -> None:
        cd = node.component_data[self.ct]
        ids = cd.session_ids
        if ids is None:
            ids = cd.session_ids = {}
        m = ids.get(sid, 0)
        ids[sid] = m + 1
        if m == 0:
            cd.session_ref += 1
            if self.mirror_on_node:
                node.full_session_ref = cd.session_ref
            if cd.session_ref == 1:
                self._on_ref_change(node, self.ct)

    def _dec(self, node: UnifiedTreeNode, sid: str) -> None:
        cd = node.component_data[self.ct]
        ids = cd.session_ids
        m = ids[sid]
        if m > 1:
            ids[sid] = m - 1
            return
        del ids[sid]
        if not ids:
            cd.session_ids = None
        cd.session_ref -= 1
        if self.mirror_on_node:
            node.full_session_ref = cd.session_ref
        if cd.session_ref == 0:
            self._on_ref_change(node, self.ct)

    def _index_leaf(self, sid: str, leaf: UnifiedTreeNode) -> None:
        self.leaves.setdefault(sid, set()).add(leaf)
        cd = leaf.component_data[self.ct]
        if cd.session_leaf_of is None:
            cd.session_leaf_of = set()
        cd.session_leaf_of.add(sid)

    def _unindex_leaf(self, sid: str, leaf: UnifiedTreeNode) -> None:
        idx = self.leaves.get(sid)
        if idx is not None:
            idx.discard(leaf)
            if not idx:
                del self.leaves[sid]
        cd = leaf.component_data[self.ct]
        if cd.session_leaf_of is not None:
            cd.session_leaf_of.discard(sid)
            if not cd.session_leaf_of:
                cd.session_leaf_of = None

    def _apply_delta(self, sid: str, added: Iterable, removed: Iterable) -> None:
        # Increment first so a node shared by both covers never touches zero
        # (no spurious partition moves).
        for n in added:
            self._inc(n, sid)
        for n in removed:
            self._dec(n, sid)

    # ---- public operations ----

    def register_session_leaf(self, sid: str, leaf: UnifiedTreeNode) -> bool:
        """Reference ``leaf`` for ``sid``.  Older leaves of the same session
        that are ancestors of ``leaf`` are subsumed, so only the difference
        between the old and new cover changes any count."""
        idx = self.leaves.get(sid)
        if idx is not None and leaf in idx:
            return False
        root = self.cache.root_node
        subsumed = []
        if idx:
            cur = leaf.parent
            while cur is not None and cur is not root:
                if cur in idx:
                    subsumed.append(cur)
                cur = cur.parent
        old_cover: list = []
        for old in subsumed:
            old_cover.extend(self.covered(old))
            self._unindex_leaf(sid, old)
        self._apply_delta(sid, self.covered(leaf), old_cover)
        self._index_leaf(sid, leaf)
        return True

    def release_session(self, sid: str) -> int:
        """Drop every reference ``sid`` holds on this component."""
        leaves = self.leaves.pop(sid, None)
        if not leaves:
            return 0
        for leaf in leaves:
            for n in self.covered(leaf):
                self._dec(n, sid)
            cd = leaf.component_data[self.ct]
            if cd.session_leaf_of is not None:
                cd.session_leaf_of.discard(sid)
                if not cd.session_leaf_of:
                    cd.session_leaf_of = None
        return len(leaves)

    def discard_deleted_session_leaf(
        self, node: UnifiedTreeNode, node_deleted: bool = True
    ) -> None:
        """``node`` is losing this component: it is being deleted from the
        tree, or (``node_deleted=False``, relocating components only) its
        state was evicted in place.  Each session holding it as a leaf moves
        its reference to the nearest reusable ancestor; a session whose walk
        reaches the root simply loses that leaf.

        A deleted node is a childless leaf, so only its own sessions cover it:
        its counts are dropped wholesale instead of one by one."""
        cd = node.component_data[self.ct]
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
        moved = None  # (added, removed): the same for every session
        for sid in sids:
            idx = self.leaves[sid]
            idx.discard(node)
            if target is None or target in idx:
                removed = self.covered(node)
                if node_deleted:
                    removed = removed[1:]  # covered() starts with the leaf
                self._apply_delta(sid, (), removed)
            else:
                if moved is None:
                    moved = self._relocation_delta(node, target, node_deleted)
                if moved[0] or moved[1]:
                    self._apply_delta(sid, *moved)
                idx.add(target)
                tcd = target.component_data[self.ct]
                if tcd.session_leaf_of is None:
                    tcd.session_leaf_of = set()
                tcd.session_leaf_of.add(sid)
            if not idx:
                del self.leaves[sid]
        if node_deleted and cd.session_ids is not None:
            cd.session_ids = None
            cd.session_ref = 0
            if self.mirror_on_node:
                node.full_session_ref = 0

    def _relocation_delta(self, node, target, node_deleted):
        """(nodes gaining, nodes losing) a reference when a leaf moves from
        ``node`` up to ``target``; a deleted ``node`` is left out (its counts
        are dropped wholesale)."""
        new, old = self.covered(target), self.covered(node)
        new_set, old_set = set(new), set(old)
        added = [n for n in new if n not in old_set]
        removed = [n for n in old if n not in new_set and not (node_deleted and n is node)]
        return added, removed

    def _nearest_reusable_ancestor(self, node: UnifiedTreeNode):
        root = self.cache.root_node
        cur = node.parent
        while cur is not None and cur is not root:
            if self.reusable(cur):
                return cur
            cur = cur.parent
        return None

    def on_split(self, new_parent: UnifiedTreeNode, child: UnifiedTreeNode) -> None:
        """``child`` was split; ``new_parent`` holds its upper part.  Leaves
        keep pointing at ``child`` (the lower end), so only ``new_parent``
        needs counts: one per covering leaf, per session."""
        ids = child.component_data[self.ct].session_ids
        if not ids:
            return
        for sid in tuple(ids):
            m = sum(
                1 for leaf in self.leaves.get(sid, ()) if new_parent in self.covered(leaf)
            )
            for _ in range(m):
                self._inc(new_parent, sid)

    # ---- checks ----

    def expected_counts(self) -> dict:
        """Recompute ``{(node_id, sid): multiplicity}`` from the leaf index."""
        expected: dict = {}
        for sid, leaves in self.leaves.items():
            for leaf in leaves:
                for n in self.covered(leaf):
                    key = (n.id, sid)
                    expected[key] = expected.get(key, 0) + 1
        return expected

    def validate(self, nodes: list) -> None:
        name = str(self.ct)
        root = self.cache.root_node
        in_tree = {n.id for n in nodes}
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
                sids = leaf.component_data[self.ct].session_leaf_of
                if not sids or sid not in sids:
                    raise SessionStateError(
                        f"[{name}] node {leaf.id} is in {sid!r}'s leaf index "
                        "but lacks the reverse entry"
                    )
        expected = self.expected_counts()
        seen = 0
        for n in nodes:
            cd = n.component_data[self.ct]
            ids = cd.session_ids or {}
            if self.mirror_on_node and n.full_session_ref != cd.session_ref:
                raise SessionStateError(
                    f"[{name}] node {n.id}: node mirror {n.full_session_ref} != "
                    f"component count {cd.session_ref}"
                )
            if cd.session_ref != len(ids):
                raise SessionStateError(
                    f"[{name}] node {n.id}: session_ref={cd.session_ref} but "
                    f"{len(ids)} sessions recorded"
                )
            for sid, m in ids.items():
                want = expected.get((n.id, sid), 0)
                if want != m:
                    raise SessionStateError(
                        f"[{name}] node {n.id}: session {sid!r} multiplicity {m}, "
                        f"leaf index implies {want}"
                    )
                seen += 1
            for sid in cd.session_leaf_of or ():
                if n not in self.leaves.get(sid, ()):
                    raise SessionStateError(
                        f"[{name}] node {n.id} claims to be a leaf of {sid!r} "
                        "but the index disagrees"
                    )
        if seen != len(expected):
            missing = [k for k in expected if k[0] not in in_tree]
            raise SessionStateError(
                f"[{name}] {len(expected) - seen} expected references are not "
                f"stored on tree nodes (e.g. {missing[:3]})"
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
    """FULL: every node from the leaf to the root is needed to reuse it."""

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

    def register_session_leaf(self, sid, leaf):
        # The path rule lets a newer leaf under an older one touch only the
        # nodes between them: walk up, stop at the nearest older leaf and hand
        # its cover over instead of dropping and re-adding it.
        idx = self.leaves.get(sid)
        if idx is not None and leaf in idx:
            return False
        root = self.cache.root_node
        added = []
        cur = leaf
        handover = None
        while cur is not None and cur is not root:
            if idx and cur in idx:
                handover = cur
                break
            added.append(cur)
            cur = cur.parent
        if handover is None:
            self._apply_delta(sid, added, ())
        else:
            self._apply_delta(sid, added, ())
            self._unindex_leaf(sid, handover)
            # Older leaves further up were covered twice; drop those extras.
            cur = handover.parent
            while cur is not None and cur is not root:
                if cur in idx:
                    self._apply_delta(sid, (), self.covered(cur))
                    self._unindex_leaf(sid, cur)
                cur = cur.parent
        self._index_leaf(sid, leaf)
        return True

    def reusable(self, node):
        cd = node.component_data[self.ct]
        return cd.value is not None or cd.host_value is not None

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

    def _relocation_delta(self, node, target, node_deleted):
        # The target is an ancestor, so its path is a suffix of the old one:
        # only the nodes strictly below it lose this reference (none at all
        # when a deleted leaf hands over to its parent — the common case).
        if node_deleted and target is node.parent:
            return (), ()
        removed = []
        cur = node.parent if node_deleted else node
        while cur is not target:
            removed.append(cur)
            cur = cur.parent
        return (), removed

    def on_split(self, new_parent, child):
        # Every leaf covering the lower part also covers the upper part.
        ids = child.component_data[self.ct].session_ids
        if not ids:
            return
        for sid, m in tuple(ids.items()):
            for _ in range(m):
                self._inc(new_parent, sid)


class SWASessionRefs(ComponentSessionRefs):
    """SWA: only the tail within ``sliding_window_size + page_size`` tokens of
    the leaf end.  A node counts when the tokens strictly below it on the path
    are fewer than that bound, so a window straddling a node takes the whole
    node (page allowance) and never more."""

    def __init__(self, component, on_ref_change):
        super().__init__(component, on_ref_change)
        self.window = component.sliding_window_size + self.cache.page_size

    def covered(self, leaf):
        root = self.cache.root_node
        out = []
        acc = 0
        cur = leaf
        window = self.window
        while cur is not None and cur is not root and acc < window:
            out.append(cur)
            acc += len(cur.key)
            cur = cur.parent
        return out

    def reusable(self, node):
        cd = node.component_data[0]  # structural: any node still holding FULL
        return cd.value is not None or cd.host_value is not None

    def _relocation_delta(self, node, target, node_deleted):
        if not node_deleted or target is not node.parent:
            return super()._relocation_delta(node, target, node_deleted)
        # Moving from a deleted leaf to its parent only widens the window:
        # parent-side nodes within reach of the parent but not of the old leaf
        # gain a reference; nothing above loses one.
        root = self.cache.root_node
        window = self.window
        below = len(node.key)
        added = []
        acc = 0
        cur = target
        while cur is not None and cur is not root and acc < window:
            if acc + below >= window:
                added.append(cur)
            acc += len(cur.key)
            cur = cur.parent
        return added, ()


class MambaSessionRefs(ComponentSessionRefs):
    """Mamba: the state on the leaf only; when it is evicted the reference
    moves to the nearest ancestor that still has a state."""

    relocate_on_device_evict = True

    def covered(self, leaf):
        return [leaf]

    def on_split(self, new_parent, child):
        # States live on leaves; the new upper node never holds a reference.
        return

    def reusable(self, node):
        cd = node.component_data[self.ct]
        return cd.value is not None or cd.host_value is not None


REFS_BY_COMPONENT = {0: FullSessionRefs, 1: SWASessionRefs, 2: MambaSessionRefs}


def make_component_refs(component, on_ref_change) -> Optional[ComponentSessionRefs]:
    cls = REFS_BY_COMPONENT.get(int(component.component_type))
    return cls(component, on_ref_change) if cls is not None else None
