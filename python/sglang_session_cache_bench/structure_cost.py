"""Cost of tree-structure events with the session cache off and on: node
splits under many sessions/leaves, and session closes.

    python -m sglang_session_cache_bench.structure_cost [--sessions 100,1000,5000]

Split cases (real ``UnifiedRadixCache.match_prefix`` calls ending inside a
node, which split it):

* ``full``: a 512-token prompt shared by N sessions, each holding one leaf
  below it; every timed match splits the shared node again.
* ``swa``:  FULL+SWA (window 64, page 1), a 128-token prompt with N short
  session leaves directly below it, so every split node is inside those
  leaves' windows.

Off and on caches are built identically and split alternately, split by
split; each cell's ratio is the median of the paired on/off ratios.  A flat
ratio across N means the split does no per-session or per-leaf work.

Close case: one session of T turns where every turn re-renders the previous
output (reasoning stripped), so the session holds T leaves on T branches (the
worst case for a close: leaves x depth before).  Reports the time of
``release_radix_session`` and how many count updates it made per covered
node, per component (FULL: 1.0 = each node once).

Move case: an SWA LRU list (``PartitionedLRUList``) of N unreferenced nodes
with about 100 referenced ones at random recencies among them, each of which
then loses its reference (a session closed, expired, withdrawn or released
at the open-session bound) and moves into the unreferenced partition at its
recency.  Two identical lists move the same nodes alternately: one as
shipped (after the first long search, through the partition's snapshot),
the other by the list search alone (forced with a walk's cursor linked, the
one case that still uses only it); the ratio is the median of the paired
shipped/search ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from array import array

SPLITS = 40


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _insert(h, ids) -> None:
    """Insert ``ids`` with fresh slots; the tree frees the ones it already
    holds (as after a prefill)."""
    import torch

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    value = h.allocator.alloc(len(ids)).to(torch.int64)
    h.cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=value))


def _reference(h, sid: str, ids) -> None:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_session_cache.patches.unified_cache import locate_node

    tracker = h.cache.session_ref_tracker
    if tracker is None:
        return
    node = locate_node(h.cache, RadixKey(array("q", ids)))
    tracker.open_radix_session(sid)
    for refs in tracker.index_owners:
        refs.register_session_leaf(sid, node)


def build_shared(kind: str, n: int, enable_session: bool):
    """``n`` sessions, one 4-token leaf each, under one shared prompt."""
    from sglang_session_cache_bench.harness import make_full_cache, make_swa_cache

    prompt_len = 512 if kind == "full" else 128
    tokens = 2 * prompt_len + 4 * n + 64  # room for one insert's duplicate
    if kind == "full":
        h = make_full_cache(num_tokens=tokens, enable_session=enable_session, head_dim=1,
                            max_context_len=2048)
    else:
        h = make_swa_cache(num_tokens=tokens, page_size=1, sliding_window_size=64,
                           enable_session=enable_session, head_dim=1, max_context_len=2048)
    prompt = list(range(1, prompt_len + 1))
    _insert(h, prompt)
    for i in range(n):
        ids = prompt + [100_000 + 4 * i + j for j in range(4)]
        _insert(h, ids)
        _reference(h, f"s{i}", ids)
    return h, prompt


def _split_once(h, prompt, k: int) -> float:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    params = MatchPrefixParams(key=RadixKey(array("q", prompt[:k])))
    start = time.perf_counter()
    h.cache.match_prefix(params)
    return time.perf_counter() - start


def split_rows(sizes, kinds=("full", "swa"), splits=SPLITS) -> list[dict]:
    rows = []
    for kind in kinds:
        for n in sizes:
            t0 = time.perf_counter()
            off, prompt = build_shared(kind, n, False)
            on, _ = build_shared(kind, n, True)
            _log(f"[split {kind} n={n}] built two trees in {time.perf_counter() - t0:.1f}s")
            nodes_before = len(on.tree_nodes())
            offs, ons, ratios = [], [], []
            # Split the top piece of the shared prompt again and again: each
            # match ends one token earlier, inside the node made last time.
            for i in range(splits):
                k = len(prompt) - 1 - i
                if i % 2:
                    b = _split_once(on, prompt, k)
                    a = _split_once(off, prompt, k)
                else:
                    a = _split_once(off, prompt, k)
                    b = _split_once(on, prompt, k)
                offs.append(a)
                ons.append(b)
                ratios.append(b / a)
            made = len(on.tree_nodes()) - nodes_before
            assert made == splits == len(off.tree_nodes()) - nodes_before, made
            on.cache.validate_session_state()
            rows.append(_row("split", kind, n, offs, ons, ratios))
            del off, on
    return rows


def _row(case, kind, n, offs, ons, ratios, **extra) -> dict:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    row = {
        "case": case, "component": kind, "n": n,
        "off_us": statistics.median(offs) * 1e6,
        "on_us": statistics.median(ons) * 1e6,
        "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
        "pairs": len(ratios),
    }
    row.update(extra)
    _log(f"[{case} {kind} n={n}] off {row['off_us']:.1f}us on {row['on_us']:.1f}us "
         f"ratio {row['ratio']:.2f}")
    return row


# ---- close ------------------------------------------------------------------


def build_rerendered_session(kind: str, turns: int, sid: str = "agent"):
    """A session whose every turn drops the previous output and appends a new
    user message: ``turns`` leaves, each on its own branch."""
    from sglang_session_cache_bench.harness import make_swa_mamba_cache, make_full_cache

    per_turn = 12
    tokens = 64 + turns * (per_turn + 8) * 2 + 64
    if kind == "full":
        h = make_full_cache(num_tokens=tokens, enable_session=True, head_dim=1,
                            max_context_len=tokens)
    else:
        h = make_swa_mamba_cache(num_tokens=tokens, enable_session=True, head_dim=1,
                                 sliding_window_size=16, mamba_num_slots=turns + 8,
                                 max_context_len=tokens)
    history = list(range(1, 65))
    for t in range(turns):
        history = history + [1000 + t * per_turn + j for j in range(per_turn)]
        output = [500_000 + t * 8 + j for j in range(8)]
        req = h.run_request(history, session_id=sid, output_ids=output, n_decode=len(output))
        assert req is not None
    return h


def _counting(refs):
    """Count ``_bump`` calls on one component's refs (instance override)."""
    counter = [0]
    orig = refs._bump

    def bump(node, delta):
        counter[0] += 1
        orig(node, delta)

    refs._bump = bump
    return counter


def close_rows(turn_counts, kinds=("full", "swa_mamba"), repeats=5) -> list[dict]:
    rows = []
    for kind in kinds:
        for turns in turn_counts:
            times, per = [], {}
            for r in range(repeats):
                h = build_rerendered_session(kind, turns)
                tracker = h.cache.session_ref_tracker
                covered = {ct: len(refs.referenced_nodes())
                           for ct, refs in tracker.components.items()}
                leaves = len(tracker.session_leaves("agent"))
                counters = {ct: _counting(refs) for ct, refs in tracker.components.items()}
                start = time.perf_counter()
                h.cache.release_radix_session("agent")
                times.append(time.perf_counter() - start)
                h.cache.validate_session_state()
                per = {str(ct): {"covered": covered[ct], "updates": counters[ct][0]}
                       for ct in covered}
            row = {
                "case": "close", "component": kind, "n": turns, "leaves": leaves,
                "close_us": statistics.median(times) * 1e6,
                "per_component": per,
            }
            _log(f"[close {kind} turns={turns}] {row['close_us']:.0f}us {per}")
            rows.append(row)
    return rows


def _move_list(n: int, referenced: int, seed: int = 0):
    from sglang.srt.mem_cache.unified_cache_components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedTreeNode

    from sglang_session_cache.partitioned_lru import PartitionedLRUList

    comps = (ComponentType.FULL, ComponentType.SWA)
    swa = ComponentType.SWA
    lru = PartitionedLRUList(swa, comps)
    rng = random.Random(seed)
    nodes, moving = [], []
    for _ in range(n):
        node = UnifiedTreeNode(comps)
        if rng.random() < referenced / n:
            node.component_data[swa].session_ref = 1
            moving.append(node)
        lru.insert_mru(node)
        nodes.append(node)
    return lru, nodes, moving


def move_rows(sizes, referenced: int = 100) -> list[dict]:
    """Partition moves into the middle of an N-node partition, as shipped vs
    the list search alone, paired move by move."""
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    swa = ComponentType.SWA
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        shipped, nodes_shipped, moving_shipped = _move_list(n, referenced)
        search, nodes_search, moving_search = _move_list(n, referenced)
        moves, searches, ratios = [], [], []
        for i, (a, b) in enumerate(zip(moving_shipped, moving_search)):
            a.component_data[swa].session_ref = 0
            b.component_data[swa].session_ref = 0
            # A cursor linked at the tail end keeps to the list search.
            search.park_cursor_before(search.tail.lru_prev[search._pt])
            timed = [(shipped, a, moves), (search, b, searches)]
            for lru, node, out in (timed if i % 2 == 0 else timed[::-1]):
                start = time.perf_counter()
                lru.move_to_partition(node)
                out.append(time.perf_counter() - start)
            search.detach_cursor()
            ratios.append(moves[-1] / searches[-1])
        for lru in (shipped, search):
            errors = lru.integrity_errors("move")
            if errors:
                raise RuntimeError("; ".join(errors[:3]))
        # Built alike, moved alike: the same order, node for node.
        orders = []
        for lru, nodes in ((shipped, nodes_shipped), (search, nodes_search)):
            index = {node.id: k for k, node in enumerate(nodes)}
            orders.append([index.get(x.id, -1) for x in lru.iter_nodes()])
        if orders[0] != orders[1]:
            raise RuntimeError("the two lists moved the same nodes to different places")
        row = {
            "case": "move", "component": "swa", "n": n, "moves": len(ratios),
            "search_us": statistics.median(searches) * 1e6,
            "move_us": statistics.median(moves) * 1e6,
            "move_max_us": max(moves) * 1e6,
            "ratio": statistics.median(ratios),
        }
        _log(f"[move n={n}] search {row['search_us']:.0f}us move {row['move_us']:.1f}us "
             f"ratio {row['ratio']:.4f} ({time.perf_counter() - t0:.1f}s)")
        rows.append(row)
    return rows


def format_table(split: list[dict], close: list[dict], move=()) -> str:
    lines = [
        "Node split, session cache off vs on (median of paired on/off ratios)",
        f"{'component':<10}{'sessions':>9}{'off us':>10}{'on us':>10}{'on/off':>8}"
        f"{'IQR':>13}{'pairs':>7}",
    ]
    for r in split:
        lines.append(
            f"{r['component']:<10}{r['n']:>9}{r['off_us']:>10.1f}{r['on_us']:>10.1f}"
            f"{r['ratio']:>8.2f}{r['ratio_q1']:>7.2f}-{r['ratio_q3']:<5.2f}{r['pairs']:>7}"
        )
    if split:
        lines.append(f"worst split on/off: {max(r['ratio'] for r in split):.2f}")
    if close:
        lines += [
            "",
            "Session close (re-rendered turns: one leaf per turn), median of repeats",
            f"{'shape':<10}{'turns':>6}{'leaves':>7}{'close us':>10}  "
            "count updates / covered nodes per component",
        ]
        for r in close:
            parts = ", ".join(
                f"{ct}: {v['updates']}/{v['covered']}" for ct, v in r["per_component"].items()
            )
            lines.append(f"{r['component']:<10}{r['n']:>6}{r['leaves']:>7}"
                         f"{r['close_us']:>10.0f}  {parts}")
    if move:
        lines += [
            "",
            "Partition move to a mid-partition recency (a released session's node), "
            "as shipped vs the list search alone, paired (median ratio)",
            f"{'list':<10}{'nodes':>8}{'moves':>7}{'search us':>11}{'move us':>9}"
            f"{'move max':>10}{'move/search':>13}",
        ]
        for r in move:
            lines.append(f"{r['component']:<10}{r['n']:>8}{r['moves']:>7}"
                         f"{r['search_us']:>11.1f}{r['move_us']:>9.1f}"
                         f"{r['move_max_us']:>10.1f}{r['ratio']:>13.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import logging

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="100,1000,5000",
                   help="sessions (= leaves) sharing the split node, comma-separated")
    p.add_argument("--turns", default="30,60,120", help="turns of the closed session")
    p.add_argument("--splits", type=int, default=SPLITS)
    p.add_argument("--move-nodes", default="10000,100000",
                   help="nodes in the partition a released session's node moves into")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    build_shared("full", 4, False)  # warm-up: the first cache built is slow
    split = split_rows([int(x) for x in args.sessions.split(",") if x], splits=args.splits)
    close = close_rows([int(x) for x in args.turns.split(",") if x])
    move = move_rows([int(x) for x in args.move_nodes.split(",") if x])
    print(format_table(split, close, move))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"split": split, "close": close, "move": move}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
