"""An independent model of what each open session protects, written from the
documented rules (docs_new/docs/advanced_features/session_radix_cache.mdx),
not from the accounting code.  It never calls the package's tracker or
component classes: it reads only the tree (nodes, keys, parents, component
values) and is told about lifecycle events by the test driving the cache.

Rules modelled:

* a request of an open session is stamped on arrival with the session's
  generation; arrivals and registrations are numbered in one sequence;
* on finish (not aborted), a request registers the node its insert ended on,
  unless its session is closed/expired (late finish) or was re-opened since
  it arrived (stale generation);
* registering supersedes the session's ancestor leaves and every leaf
  registered before the request arrived; a leaf reached twice keeps its
  newest registration;
* close / expiry drops all of a session's leaves; an explicit open starts a
  new generation and keeps the leaves;
* when a node holding a session leaf is deleted, the leaf moves to the
  nearest ancestor that still holds FULL KV (Mamba: a Mamba state); when a
  Mamba state is evicted in place the Mamba leaf moves the same way;
* coverage per component: FULL the whole path to the root; SWA the nodes
  from the leaf up while fewer than window + page tokens lie strictly below
  them on the path; Mamba the leaf only.
"""

from __future__ import annotations

import itertools
from typing import Optional

FULL, SWA, MAMBA = 0, 1, 2


def _has_full(node) -> bool:
    cd = node.component_data[FULL]
    return cd.value is not None or cd.host_value is not None


def _has_mamba(node) -> bool:
    cd = node.component_data[MAMBA]
    return cd.value is not None or cd.host_value is not None


class SessionModel:
    def __init__(self, cache, components, window: Optional[int]):
        self.cache = cache
        self.components = tuple(int(c) for c in components)
        self.window = window  # sliding window + page size (SWA shapes)
        self.open: dict = {}  # sid -> model generation
        self.closed: set = set()
        self.events = itertools.count(1)
        self.generations = itertools.count(1)
        # per component: sid -> {node: (registered, arrived)}
        self.leaves = {ct: {} for ct in self.components}
        self.reqs: dict = {}  # rid -> (sid, generation, arrival)

    # ---- lifecycle ----

    def _open(self, sid, new_generation: bool):
        if sid in self.open and not new_generation:
            return self.open[sid]
        self.closed.discard(sid)
        gen = next(self.generations)
        self.open[sid] = gen
        return gen

    def explicit_open(self, sid):
        self._open(sid, new_generation=True)

    def arrive(self, req, sid):
        if sid is None or req.rid in self.reqs:
            return
        gen = self._open(sid, new_generation=False)
        self.reqs[req.rid] = (sid, gen, next(self.events))

    def release(self, sid):
        """Close or expiry."""
        self.open.pop(sid, None)
        self.closed.add(sid)
        for per_sid in self.leaves.values():
            per_sid.pop(sid, None)

    def finish(self, req, aborted: bool):
        entry = self.reqs.pop(req.rid, None)
        if entry is None or aborted:
            return
        sid, gen, arrived = entry
        if self.open.get(sid) != gen:
            return  # closed/expired (late) or re-opened (stale)
        leaf = self.insert_end(req)
        if leaf is None:
            return
        stamp = next(self.events)
        for ct in self.components:
            mine = self.leaves[ct].setdefault(sid, {})
            for anc in self.ancestors(leaf):
                mine.pop(anc, None)
            for node in [n for n, t in mine.items() if t[0] < arrived and n is not leaf]:
                del mine[node]
            mine[leaf] = max((stamp, arrived), mine.get(leaf, (0, 0)))

    def insert_end(self, req):
        """The node whose path spells the longest prefix of the request's
        tokens made of whole nodes (outputs are unique, so nothing deeper
        matches): where its finishing insert ended.  None at the root."""
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        node, pos = self.cache.root_node, 0
        while True:
            nxt = None
            for child in node.children.values():
                key = list(child.key.token_ids)
                if tokens[pos:pos + len(key)] == key:
                    nxt = child
                    break
            if nxt is None:
                break
            pos += len(nxt.key)
            node = nxt
        return None if node is self.cache.root_node else node

    def ancestors(self, node):
        root = self.cache.root_node
        cur = node.parent
        while cur is not None and cur is not root:
            yield cur
            cur = cur.parent

    # ---- tree events (observed on the real cache) ----

    def _move(self, ct, node, usable):
        target = next((a for a in self.ancestors(node) if usable(a)), None)
        for sid, mine in list(self.leaves[ct].items()):
            turn = mine.pop(node, None)
            if turn is None:
                continue
            if target is not None:
                mine[target] = max(turn, mine.get(target, turn))
            if not mine:
                del self.leaves[ct][sid]

    def node_deleted(self, node):
        for ct in self.components:
            self._move(ct, node, _has_mamba if ct == MAMBA else _has_full)

    def mamba_evicted(self, node):
        if MAMBA in self.components and _has_mamba(node):
            self._move(MAMBA, node, _has_mamba)

    # ---- expectations ----

    def covered(self, ct, leaf):
        if ct == MAMBA:
            return [leaf]
        out, below, cur, root = [], 0, leaf, self.cache.root_node
        while cur is not None and cur is not root:
            if ct == SWA and below >= self.window:
                break
            out.append(cur)
            below += len(cur.key)
            cur = cur.parent
        return out

    def expected(self, ct) -> dict:
        """{node id: {session id: number of its leaves covering the node}}."""
        out: dict = {}
        for sid, mine in self.leaves[ct].items():
            for leaf in mine:
                for n in self.covered(ct, leaf):
                    per = out.setdefault(n.id, {})
                    per[sid] = per.get(sid, 0) + 1
        return out

    def check(self, nodes, tracker) -> None:
        """Compare with the cache: open sessions, each session's leaves and
        every node's stored count per component (FULL: distinct sessions on
        the path; SWA/Mamba: leaf references covering the node)."""
        assert set(self.open) == set(tracker.open_sessions()), (
            sorted(self.open), sorted(tracker.open_sessions()))
        for ct in self.components:
            for sid in set(self.leaves[ct]) | set(self.open):
                want = {n.id for n in self.leaves[ct].get(sid, ())}
                got = {n.id for n in tracker.session_leaves(sid, ct)}
                assert want == got, f"[{ct}] leaves of {sid!r}: model {want} cache {got}"
            expected = self.expected(ct)
            for n in nodes:
                per = expected.get(n.id)
                if per is None:
                    want = 0
                elif ct == FULL:
                    want = len(per)
                else:
                    want = sum(per.values())
                got = n.component_data[ct].session_ref
                assert got == want, f"[{ct}] node {n.id}: model {want} ({per}) cache {got}"
