"""Close a session on every worker behind a router.

SGLang Model Gateway (``smg`` 1.13.0) routes ``/generate`` by routing key but
has no ``/close_session`` route, so a close sent to the router never reaches
the worker that holds the session.  Closing on *every* worker is safe -- an
unknown session's close is a no-op on SGLang -- and needs no routing state:

    python -m sglang_session_cache.close_fanout --router http://127.0.0.1:30000 agent-42
    python -m sglang_session_cache.close_fanout --worker http://w1:8000 --worker http://w2:8000 agent-42

``--router`` asks the router for its workers (``GET /workers``).  The session
TTL (``--session-radix-cache-ttl``) stays the backstop for closes that never
arrive.  Standard library only; one thread per worker.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

from sglang_session_cache.session_ids import validate_session_id

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class CloseResult:
    worker: str
    ok: bool
    status: Optional[int] = None
    error: str = ""


# smg --dp-aware lists a worker once per DP rank, as ``<url>@<rank>``; the
# server behind them is one (its /close_session reaches every rank).
_DP_RANK_SUFFIX = re.compile(r"@\d+$")


def router_workers(router_url: str, timeout: float = DEFAULT_TIMEOUT_S,
                   skipped: Optional[list] = None) -> list:
    """HTTP worker URLs the router knows, from its ``GET /workers`` listing
    (DP-rank entries folded into their server).  Workers it cannot reach over
    HTTP (gRPC) are appended to ``skipped`` when given."""
    with urllib.request.urlopen(router_url.rstrip("/") + "/workers", timeout=timeout) as r:
        doc = json.loads(r.read().decode("utf-8"))
    items = doc.get("workers", doc) if isinstance(doc, dict) else doc
    urls = []
    for item in items if isinstance(items, list) else []:
        url = item.get("url") if isinstance(item, dict) else item
        if not isinstance(url, str):
            continue
        if not url.startswith(("http://", "https://")):
            if skipped is not None and url not in skipped:
                skipped.append(url)
            continue
        url = _DP_RANK_SUFFIX.sub("", url)
        if url not in urls:
            urls.append(url)
    if not urls:
        raise ValueError(f"{router_url}/workers lists no HTTP workers: {str(doc)[:500]}")
    return urls


def _close_one(worker: str, session_id: str, timeout: float) -> CloseResult:
    body = json.dumps({"session_id": session_id}).encode("utf-8")
    req = urllib.request.Request(
        worker.rstrip("/") + "/close_session", data=body, method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return CloseResult(worker, 200 <= r.status < 300, r.status)
    except urllib.error.HTTPError as e:
        return CloseResult(worker, False, e.code, e.read().decode("utf-8", "replace")[:200])
    except Exception as e:  # noqa: BLE001 - unreachable, bad URL, broken reply: this worker failed
        return CloseResult(worker, False, None, f"{type(e).__name__}: {e}")


def close_everywhere(session_id: str, workers: Iterable[str],
                     timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """POST ``/close_session`` for ``session_id`` to every worker at once.
    Never raises for a worker that fails: each gets a ``CloseResult``."""
    session_id = validate_session_id(session_id)  # the servers' own rule: fail here, once
    workers = list(dict.fromkeys(workers))
    if not workers:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(workers))) as pool:
        return list(pool.map(lambda w: _close_one(w, session_id, timeout), workers))


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_session_cache.close_fanout",
        description="POST /close_session for a session to every worker behind a router.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--router", help="router URL; workers come from its GET /workers")
    src.add_argument("--worker", action="append", dest="workers",
                     help="a worker URL (repeat for each worker)")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds per HTTP call (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("session_id", nargs="+")
    args = p.parse_args(argv)
    try:
        for sid in args.session_id:
            validate_session_id(sid)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    skipped: list = []
    try:
        workers = args.workers or router_workers(args.router, args.timeout, skipped)
    except Exception as exc:  # noqa: BLE001 - the router's listing: report, no traceback
        print(f"error: cannot list the workers of {args.router}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    for url in skipped:
        print(f"warning: {url} is not an HTTP worker; its sessions are not closed here "
              "(they end by the session TTL)", file=sys.stderr)
    failed = 0
    for sid in args.session_id:
        for r in close_everywhere(sid, workers, args.timeout):
            failed += not r.ok
            print(f"{sid}\t{r.worker}\t{'ok' if r.ok else 'FAILED'}\t"
                  f"{r.status if r.status is not None else '-'}\t{r.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
