"""``sglang_session_cache.close_fanout``: a close reaches every worker.

The workers and the router listing here are stand-in HTTP endpoints on
127.0.0.1 that record what they receive (a live SGLang server per case would
cost a minute of CPU each; ``smg_live`` runs the helper against real workers
behind the real router).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_session_cache.close_fanout import close_everywhere, main, router_workers


class _StandInEndpoint:
    """Records POST bodies; answers GET /workers with ``listing``."""

    def __init__(self, status: int = 200, listing=None):
        self.posts: list = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.posts.append((self.path, json.loads(body)))
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"{}")

            def do_GET(self):
                data = json.dumps(listing).encode()
                self.send_response(200 if listing is not None else 404)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints():
    made = []

    def make(**kw):
        e = _StandInEndpoint(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_close_reaches_every_worker(endpoints):
    a, b = endpoints(), endpoints()
    results = close_everywhere("agent-1", [a.url, b.url, a.url])  # duplicates once
    assert [r.ok for r in results] == [True, True]
    assert a.posts == [("/close_session", {"session_id": "agent-1"})]
    assert b.posts == [("/close_session", {"session_id": "agent-1"})]


def test_failures_are_reported_not_raised(endpoints):
    good, bad = endpoints(), endpoints(status=500)
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    results = {r.worker: r for r in close_everywhere("s", [good.url, bad.url, dead], timeout=3)}
    assert results[good.url].ok
    assert not results[bad.url].ok and results[bad.url].status == 500
    assert not results[dead].ok and results[dead].status is None and results[dead].error
    assert good.posts == [("/close_session", {"session_id": "s"})]


def test_bad_session_id_raises_before_sending(endpoints):
    a = endpoints()
    for sid in ("", None, 5, "   ", "a\x00b", "x" * 257):
        with pytest.raises(ValueError):
            close_everywhere(sid, [a.url])
    assert a.posts == []
    assert main(["--worker", a.url, "ok", "bad\nid"]) == 2  # checked before any close
    assert a.posts == []
    assert close_everywhere("s", []) == []


def test_router_listing(endpoints):
    w1, w2 = endpoints(), endpoints()
    router = endpoints(listing={"workers": [{"url": w1.url, "is_healthy": True},
                                            {"url": w2.url}, {"url": w1.url}],
                                "total": 3})
    assert router_workers(router.url) == [w1.url, w2.url]
    empty = endpoints(listing={"workers": [], "total": 0})
    with pytest.raises(ValueError):
        router_workers(empty.url)


def test_cli(endpoints, capsys):
    w1, w2 = endpoints(), endpoints(status=503)
    router = endpoints(listing={"workers": [{"url": w1.url}, {"url": w2.url}]})
    assert main(["--router", router.url, "s1", "s2"]) == 1  # w2 fails
    out = capsys.readouterr().out
    assert out.count("\tok\t") == 2 and out.count("FAILED") == 2
    assert [p[1]["session_id"] for p in w1.posts] == ["s1", "s2"]
    assert main(["--worker", w1.url, "s3"]) == 0


def test_dp_aware_router_listing_folds_rank_entries(endpoints, capsys):
    # smg --dp-aware lists each worker once per DP rank as "<url>@<rank>"
    # (measured on smg 1.13.0); the close goes to the server once.
    w1, w2 = endpoints(), endpoints()
    router = endpoints(listing={"workers": [
        {"url": f"{w1.url}@0"}, {"url": f"{w1.url}@1"}, {"url": f"{w2.url}@0"},
        {"url": "grpc://10.0.0.9:50051"}]})
    skipped = []
    assert router_workers(router.url, skipped=skipped) == [w1.url, w2.url]
    assert skipped == ["grpc://10.0.0.9:50051"]
    assert main(["--router", router.url, "s"]) == 0
    assert w1.posts == w2.posts == [("/close_session", {"session_id": "s"})]
    assert "grpc://10.0.0.9:50051 is not an HTTP worker" in capsys.readouterr().err


def test_any_worker_error_is_a_failed_result_and_a_bad_router_no_traceback(endpoints, capsys):
    good = endpoints()
    # A malformed URL raises ValueError / InvalidURL inside urllib, not URLError.
    results = close_everywhere("s", [good.url, "localhost:1", "http://127.0.0.1:port"], timeout=3)
    assert [r.ok for r in results] == [True, False, False]
    assert all(r.error for r in results[1:])
    assert main(["--router", "http://127.0.0.1:9", "--timeout", "3", "s"]) == 2
    assert "cannot list the workers" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["-1", "0", "inf", "soon"])
def test_a_bad_timeout_is_a_usage_error(timeout, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--router", "http://127.0.0.1:9", "--timeout", timeout, "s"])
    assert exc.value.code == 2
    assert "--timeout" in capsys.readouterr().err
