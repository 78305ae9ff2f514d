"""How much of the pool protection may hold, learned from what it cost: a
scale on ``--session-radix-cache-max-protected-fraction``.

Protection ranks any referenced KV above any unreferenced KV.  That is right
for sessions that come back, and wrong when unreferenced KV is the one in
demand -- one-shot requests over a few shared documents, which plain LRU
would keep, evicted for session KV that is read once more, or never.  Which
side is worth more is workload-dependent, so it is measured, in the spirit of
ARC's ghost lists:

* While references exist, each **unreferenced** FULL node evicted from the
  device leaves a *ghost*: its place (parent node, namespace and first page,
  as the tree keys children) and its size.  While none exist and the scale
  is below 1 it leaves one too, marked: protection did not push that KV
  out, so only a returning session's miss on it counts (below).  Without
  those, a bound that fits no session's path would keep nothing referenced
  and the scale could never grow back.  Ghosts are bounded to one pool of tokens, oldest dropped first.
* When a request's device match stops exactly where a ghost was (same parent,
  namespace and next tokens), the request missed KV that protection pushed out:
  - from a session that has **returned** (its second request or later), the
    miss says the session's own, unprotected KV was needed: the scale grows,
    in full when that KV was just evicted and linearly less up to
    ``RETURN_WINDOW`` of a pool of unreferenced evictions later, not at all
    after (see below);
  - from anything else (untagged traffic, a session's first request), it says
    the unreferenced KV that lost its room to protection was needed: the
    scale shrinks.

Each hit moves the scale by the ghost's size over the pool size (token
weighted, like the hit rate), between 0 (nothing protected: the session
cache off) and 1 (the configured fraction).  A ghost is used once.

Early on each step is larger: ``EARLY_BOOST`` times the ghost's share of the
pool before any ghost was recorded, falling linearly to 1 once
``EARLY_WINDOW`` pools of ghost tokens were.  The scale starts at full
protection and learns only from misses that already happened, so on traffic
that wants less (two hot documents shared by untagged requests) the
documents paid for the whole descent; boosted, the scale reaches what the
traffic asks for within about a pool of evictions, and afterwards moves no
faster than the misses.  Growth is boosted alike, so traffic that wants
protection gets it back as fast.  The window is counted in ghost tokens,
not time, like everything here.

Why a returning session's miss fades with the ghost's age: protecting a
session holds its KV for the whole gap until it returns, so what protection
buys is hits per token held.  A hot shared document is asked for again soon
after it is pushed out (a young ghost); a session that comes back long after
losing its KV would have lost it under plain LRU too, and counting it in
full let sessions hold KV that hot documents needed (measured: two hot
documents, ``ttl`` mode, 16 % pool, on 11 % below off; with the fade, 2 %).
Age is counted in unreferenced tokens evicted since, not in time.

Node ids and token contents are the same on every TP/PP rank that applies the
same operations, and nothing here reads a clock, so every rank scales the
same.  Costs: one dict insert per such eviction, one lookup per request
match.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

#: Leading tokens a ghost keeps to measure a hit: the tree keys children by
#: their first page only, and a request may share only the start of an
#: evicted node (a one-shot prompt's template, not its body).  A request that
#: agrees on all of them is counted as missing the whole node.
GHOST_CHECK_TOKENS = 256
#: Ghosts kept, as a share of the pool (measured: 1.0 beat 0.3, 0.1 and
#: 0.03 on the shared-documents workload; smaller windows miss the documents).
GHOST_BUDGET = 1.0
#: The scale moves EARLY_BOOST times as fast while it has seen little, less
#: so as ghosts are recorded, at its own pace once EARLY_WINDOW pools of
#: ghost tokens were (measured on the two-hot-document sweep, worst cell of
#: seeds 0/2/3 against off: no boost -2.1/-1.6/-0.7 %, 4: -1.1/-0.9/-0.5 %,
#: 8: -0.9/-0.7/-0.5 %, 16: -0.3/-0.7/-0.2 %, 32: -0.3/-0.9/-0.2 %; with 8, a
#: window of half a pool -1.4 % on seed 0, two pools -1.0/-0.9/-0.5 %; at 16
#: the default workload loses at most 0.5 pt, FULL+SWA at the 3-5 % pools).
EARLY_BOOST = 16.0
EARLY_WINDOW = 1.0
#: A returning session's ghost miss counts in full when the ghost is new and
#: not at all once this share of a pool of unreferenced tokens was evicted
#: after it (measured on the shared-documents workloads: 0.25 and 0.1 came
#: out alike, 0.5 and 1.0 kept sessions on well below off).
RETURN_WINDOW = 0.25


def ghost_key(parent_id: int, tokens, page: int = 1, start: int = 0,
              extra_key=None) -> tuple:
    """A child's place: its parent, its namespace (``RadixKey.extra_key``:
    LoRA id, cache salt) and its first page -- how the radix tree itself
    keys children, so two children of one parent never collide;
    ``tokens`` read from ``start``.  Page 1 keys the token itself, without a
    slice and a tuple: this runs on every eviction and match that learns."""
    if page == 1:
        return (parent_id, extra_key, tokens[start])
    return (parent_id, extra_key, tuple(tokens[start:start + page]))


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if type(a) is not type(b):  # slices of mixed sequence types never compare equal
        for i in range(n):
            if a[i] != b[i]:
                return i
        return n
    if a[:n] == b[:n]:  # the common case (a request reusing the node), one C compare
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ProtectionScale:
    def __init__(self, page: int = 1):
        self.page = page
        self.scale = 1.0
        self.capacity = 0  # FULL pool tokens
        self.budget = 0  # most ghost tokens kept
        self.ghosts: OrderedDict = OrderedDict()
        self.ghost_tokens = 0
        self.ghost_clock = 0  # ghost tokens ever recorded: a ghost's age
        # monotonic counters
        self.grew = 0  # ghost hits by returning sessions
        self.shrank = 0  # ghost hits by other requests

    def configure(self, capacity: Optional[int]) -> None:
        """Learn against a FULL pool of ``capacity`` tokens; ``None``: do
        not learn (no ghosts are kept)."""
        self.capacity = capacity or 0
        self.budget = int(self.capacity * GHOST_BUDGET)
        if not self.capacity:
            self.forget()
        self._trim()

    def forget(self) -> None:
        """The tree was reset: its node ids are gone."""
        self.ghosts.clear()
        self.ghost_tokens = 0

    def evicted(self, parent_id: int, node_id: int, tokens, size: int,
                state: bool = True, whole_only: bool = False, extra_key=None,
                pushed_out: bool = True) -> None:
        """``state``: the node could end a match (Mamba: it held a state);
        ``whole_only``: a match cannot end inside it (Mamba caches);
        ``extra_key``: the node's namespace; ``pushed_out``: references held
        other KV when it went (else only a returning session's miss on it
        counts: protection did not push it out, but could have kept it)."""
        if not self.capacity or size <= 0:
            return
        key = ghost_key(parent_id, tokens, self.page, 0, extra_key)
        ghosts = self.ghosts
        old = ghosts.pop(key, None)
        # The evicted node's own key: tree keys are never changed in place
        # (a split gives both parts new ones), so a short one is kept as is.
        head = tokens if len(tokens) <= GHOST_CHECK_TOKENS else tokens[:GHOST_CHECK_TOKENS]
        self.ghost_clock += size
        ghosts[key] = (size, node_id, head, state, whole_only, self.ghost_clock, pushed_out)
        self.ghost_tokens += size - old[0] if old else size
        if self.ghost_tokens > self.budget:  # runs on every such eviction
            self._trim()

    def _trim(self) -> None:
        ghosts = self.ghosts
        while self.ghost_tokens > self.budget and ghosts:
            _, (size, *_) = ghosts.popitem(last=False)
            self.ghost_tokens -= size

    def missed(self, parent_id: int, tokens, returning: bool, start: int = 0,
               end: Optional[int] = None, extra_key=None) -> bool:
        """A match (in namespace ``extra_key``) stopped below ``parent_id``
        before ``tokens[start:end]`` (offsets instead of a slice: a prompt's
        unmatched rest can be long).  Returns whether the scale shrank
        (limits must be re-applied)."""
        ghosts = self.ghosts
        if not ghosts:
            return False
        end = len(tokens) if end is None else min(end, len(tokens))
        if start >= end:
            return False
        # Follow the evicted chain (leaves go first, then their parents), so
        # the miss counts all the KV the request lost, not just its top node.
        # Only what the request could have reused counts: up to the deepest
        # evicted node that could end a match (Mamba: one with a state).
        lost = counted = 0
        newest = None  # stamp of the chain's first ghost (evicted last)
        pushed_out = False  # and whether references held other KV then
        want = end - start
        page = self.page
        while True:
            at = start + lost
            if at + page > end and page > 1:
                break  # a partial page: the tree keys none
            key = ghost_key(parent_id, tokens, page, at, extra_key)
            ghost = ghosts.get(key)
            if ghost is None:
                break
            size, parent_id, head, state, whole_only, stamp, pushed = ghost
            if newest is None:
                newest, pushed_out = stamp, pushed
            del ghosts[key]
            self.ghost_tokens -= size
            same = _common_prefix(head, tokens[at:min(at + len(head), end)])
            if same < len(head):  # the request leaves the evicted node early
                if not whole_only:
                    counted = lost + same
                break
            lost += size
            if state:
                counted = lost
            if lost >= want:
                break
        lost = counted
        if lost and returning:
            lost *= self.return_weight(newest)
        if not lost or not (returning or pushed_out):
            return False
        step = lost / self.capacity * self.early_boost()
        if returning:
            self.grew += 1
            self.scale = min(1.0, self.scale + step)
            return False
        self.shrank += 1
        old = self.scale
        self.scale = max(0.0, self.scale - step)
        return self.scale < old

    def early_boost(self) -> float:
        """How much faster than its own pace the scale moves now: EARLY_BOOST
        before any ghost, falling linearly to 1 over the first EARLY_WINDOW
        pools of ghost tokens recorded."""
        seen = self.ghost_clock / (EARLY_WINDOW * self.capacity)
        return 1.0 + (EARLY_BOOST - 1.0) * max(0.0, 1.0 - seen)

    def return_weight(self, stamp: int) -> float:
        """How much a returning session's miss on a ghost recorded at
        ``stamp`` counts: 1 when nothing was evicted after it, 0 from
        ``RETURN_WINDOW`` of a pool on."""
        window = RETURN_WINDOW * self.capacity
        return max(0.0, 1.0 - (self.ghost_clock - stamp) / window)

    def validate(self) -> Optional[str]:
        if not 0.0 <= self.scale <= 1.0:
            return f"scale {self.scale} outside [0, 1]"
        total = sum(g[0] for g in self.ghosts.values())
        if self.ghost_tokens != total:
            return f"ghost tokens {self.ghost_tokens} != {total}"
        if self.ghost_tokens > self.budget:
            return f"ghost tokens {self.ghost_tokens} exceed the budget {self.budget}"
        return None


__all__ = ["GHOST_BUDGET", "RETURN_WINDOW", "ProtectionScale", "ghost_key"]
