"""E2E scale-out on live CPU servers (tiny Llama): a session's turns must land
where its KV is.

* ``dp``: one ``--dp-size 2`` server (SGLang's DataParallelController, two
  scheduler processes) with the session cache and its DP affinity on;
  ``dp_rr``: the same with ``--disable-session-dp-affinity`` (stock round
  robin), the contrast.
* ``w0``/``w1``: two single-rank workers behind the real SGLang Model Gateway
  (``smg launch --policy manual``, the pinned PyPI ``smg``), the session id
  sent as the routing key; closes go to every worker through
  ``sglang_session_cache.close_fanout`` (the router has no /close_session).

All four servers start once, in parallel.
"""

import pytest

from live_utils import close, generate, metric_values, module_servers, reuses_previous_turn
from sglang_session_cache.close_fanout import close_everywhere, router_workers
from sglang_session_cache_bench.dp_live import AFFINITY_LINE, interleaved_turns, prefills_per_rank
from sglang_session_cache_bench.live_server import LaunchedServer
from sglang_session_cache_bench.smg_live import Router, replay, small_trace


@pytest.fixture(scope="module")
def servers(request):
    return module_servers(request, {
        "dp": LaunchedServer("llama", name="llama-dp2", extra_args=["--dp-size", "2"]),
        "dp_rr": LaunchedServer("llama", name="llama-dp2-rr",
                                extra_args=["--dp-size", "2", "--disable-session-dp-affinity"]),
        "w0": LaunchedServer("llama", name="smg-w0", extra_args=["--enable-metrics"]),
        "w1": LaunchedServer("llama", name="smg-w1", extra_args=["--enable-metrics"]),
    # Six scheduler processes start at once here (two per DP server): on a
    # 2-core box under a full test run that has taken over 300 s.
    }, startup_timeout=900)


def test_dp_affinity_keeps_every_turn_on_the_rank_holding_its_kv(servers):
    srv = servers["dp"]
    rows = interleaved_turns(srv.url, sessions=3, turns=3, seed=7)
    for r in rows:
        if r["turn"] > 1:
            assert reuses_previous_turn(r["cached"], r["prev"]), rows
    log = srv.log_text()
    assert AFFINITY_LINE in log  # the patch reached the spawned controller
    # The sessions are spread over both ranks, not pinned to one.
    assert set(prefills_per_rank(log)) == {"0", "1"}
    for sid in {r["session"] for r in rows}:
        assert close(srv.url, sid).status_code == 200
        assert close(srv.url, sid).status_code == 200  # again: harmless
    generate(srv.url, [1, 2, 3])  # still serving


def test_without_affinity_round_robin_moves_sessions_off_their_kv(servers):
    srv = servers["dp_rr"]
    rows = interleaved_turns(srv.url, sessions=3, turns=3, seed=7)
    assert AFFINITY_LINE not in srv.log_text()
    missed = [r for r in rows
              if r["turn"] > 1 and not reuses_previous_turn(r["cached"], r["prev"])]
    assert missed, rows  # the contrast: stock routing loses the session's KV


def test_smg_manual_policy_routes_each_session_to_one_worker(servers, tmp_path):
    workers = [servers["w0"].url, servers["w1"].url]
    router = Router(workers, "manual", str(tmp_path / "smg.log"))
    try:
        router.start(len(workers))
        assert sorted(router_workers(router.url)) == sorted(workers)
        run = replay(router, workers, small_trace(seed=0, sessions=6), prefix="smg-")
    finally:
        router.stop()
    # Every session's turns reached one worker, so its KV was there to reuse.
    assert run.session_workers and run.sessions_split == 0, run.as_dict()
    assert set(run.per_worker) == {0, 1}, run.per_worker  # both workers used
    assert run.hit_rate > 0.5, run.as_dict()
    # Closes reach every worker although the router has no /close_session.
    assert run.close_results and all(c["ok"] for c in run.close_results), run.close_results
    assert run.router_close_status == 404
    # Closing every session through the fan-out leaves none open on any worker.
    for sid in run.session_workers:
        assert all(r.ok for r in close_everywhere(sid, workers))
    for w in workers:
        generate(w, [1, 2, 3])  # the scheduler publishes its gauges with a batch
        assert sum(metric_values(w, "sglang:session_radix_open_sessions")) == 0
