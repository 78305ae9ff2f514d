"""A real ``--dp-size 2`` CPU server: do a session's turns reuse its KV?

    python -m sglang_session_cache_bench.dp_live [--no-affinity]

Starts one tiny-model server (the ``live`` launcher) with ``--dp-size 2`` and
the session cache on (affinity on by default; ``--no-affinity`` passes
``--disable-session-dp-affinity``), sends a few sessions' turns one at a time
-- every turn resends the conversation so far -- and prints, per turn, the
prompt tokens and ``meta_info.cached_tokens``.  With affinity every follow-up
turn reuses at least the previous turn's prompt; with round robin the turns
alternate between the two ranks' caches.  Also reports the controller's
"Session DP affinity on" start-up line and any Traceback in the server log.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import urllib.request
from typing import Optional

from sglang_session_cache_bench.live_server import LaunchedServer
from sglang_session_cache_bench.tiny_models import VOCAB_SIZE

AFFINITY_LINE = "Session DP affinity on"
_PREFILL = re.compile(r"^\[[^\]]* DP(\d+)\] Prefill batch", re.M)


def _generate(url: str, ids: list, sid: str, n_out: int) -> dict:
    body = {"input_ids": ids, "session_id": sid,
            "sampling_params": {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def interleaved_turns(url: str, sessions: int = 3, turns: int = 4, seed: int = 0) -> list:
    """``sessions`` conversations sent one turn of each in turn (so a plain
    round robin over two ranks moves every session of an odd count each
    turn); every turn resends the conversation so far plus 32 new tokens.
    One row per request: session, turn, prompt and cached tokens, and
    ``prev``, the previous turn's prompt plus output (0 on the first)."""
    rng = random.Random(seed)
    convs = {f"s{i}": [rng.randrange(VOCAB_SIZE) for _ in range(64)] for i in range(sessions)}
    prev = dict.fromkeys(convs, 0)
    rows = []
    for t in range(turns):
        for sid, conv in convs.items():
            out = _generate(url, conv, sid, 4)
            meta = out["meta_info"]
            rows.append({"session": sid, "turn": t + 1, "prompt": meta["prompt_tokens"],
                         "cached": meta.get("cached_tokens", 0), "prev": prev[sid]})
            # The next turn resends this prompt plus new tokens (the model's
            # output ids when the response carries them).
            conv += list(out.get("output_ids") or [])
            prev[sid] = len(conv)
            conv += [rng.randrange(VOCAB_SIZE) for _ in range(32)]
    return rows


def prefills_per_rank(log: str) -> dict:
    """DP rank -> prefill batches, from the scheduler log lines."""
    ranks = _PREFILL.findall(log)
    return {k: ranks.count(k) for k in sorted(set(ranks))}


def run(affinity: bool, sessions: int = 3, turns: int = 4, seed: int = 0,
        startup_timeout: float = 900) -> dict:
    extra = ["--dp-size", "2"] + ([] if affinity else ["--disable-session-dp-affinity"])
    with LaunchedServer("llama", name=f"dp2-{'aff' if affinity else 'rr'}",
                        extra_args=extra) as srv:
        srv.wait_ready(startup_timeout)
        rows = interleaved_turns(srv.url, sessions, turns, seed)
        log = srv.log_text()
    followups = [r for r in rows if r["turn"] > 1]
    return {
        "affinity": affinity,
        "rows": rows,
        "followup_hit": sum(r["cached"] for r in followups) / max(1, sum(r["prompt"] for r in followups)),
        "affinity_line": AFFINITY_LINE in log,
        "prefills_per_rank": prefills_per_rank(log),
        "traceback": "Traceback" in log,
        "log_path": str(srv.log_path),
    }


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_session_cache_bench.dp_live")
    p.add_argument("--no-affinity", action="store_true")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args(argv)
    res = run(not args.no_affinity, args.sessions, args.turns)
    print(f"--dp-size 2, affinity {'on' if res['affinity'] else 'off'}; "
          f"controller line present: {res['affinity_line']}; Traceback in log: {res['traceback']}")
    print(f"{'session':<8} {'turn':>4} {'prompt':>7} {'cached':>7}")
    for r in res["rows"]:
        print(f"{r['session']:<8} {r['turn']:>4} {r['prompt']:>7} {r['cached']:>7}")
    print(f"prefill batches per DP rank (scheduler log): {res['prefills_per_rank']}")
    print(f"follow-up turns: cached / prompt = {res['followup_hit']:.3f}; log: {res['log_path']}")
    return 1 if res["traceback"] else 0


if __name__ == "__main__":
    sys.exit(main())
