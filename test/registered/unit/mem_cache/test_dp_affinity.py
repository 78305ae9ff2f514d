"""Session affinity across DP ranks.

* the policy (``SessionAffinity``): binding, overload guard, close, TTL, cap;
* the options: CLI flags, ``ServerArgs`` keywords, validation, pickling;
* the real ``DataParallelController``, run like SGLang runs it -- its own
  spawned process started with ``run_data_parallel_controller_process``, real
  ZMQ ipc sockets from the tokenizer side to the controller and from the
  controller to every rank, real SHM load snapshots -- with stand-in scheduler
  processes (``dp_stand_ins``) that report where each message landed.  That
  the routing changes in the spawned process shows activation reached it.
"""

from __future__ import annotations

import array
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest

import sglang_session_cache  # noqa: F401  (activation)
from sglang_session_cache.dp_affinity import SessionAffinity
from sglang_session_cache.dp_affinity_options import AffinityOptionError
from sglang_session_cache.patches.dp_controller import affinity_wanted, session_key

from sglang.srt.server_args import PortArgs, ServerArgs, prepare_server_args  # noqa: E402

from dp_stand_ins import COLLECTOR_ENV, run_controller_forking_stand_ins  # noqa: E402


# ---------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------


def test_first_turn_binds_least_loaded_then_follows():
    aff = SessionAffinity(overload_factor=1.5)
    assert aff.route("a", [0, 1, 2], [30, 10, 20], now=0) == 1
    # Loads change, the session stays (no overload: 20 < 1.5 x the others' 15).
    assert aff.route("a", [0, 1, 2], [10, 20, 20], now=1) == 1
    assert aff.rank_of("a") == 1
    assert aff.counters.bound == 1 and aff.counters.followed == 1


def test_ties_go_to_the_rank_with_fewest_sessions_then_the_lowest():
    aff = SessionAffinity()
    assert aff.route("a", [2, 0, 1], [5, 5, 5], now=0) == 0
    assert aff.route("b", [2, 1], [0, 7, 7], now=0) == 1
    # An idle server (all loads equal): new sessions still spread.
    idle = SessionAffinity()
    assert [idle.route(f"s{i}", [0, 1, 2], [0, 0, 0], now=i) for i in range(6)] == \
        [0, 1, 2, 0, 1, 2]
    idle.close("s1")
    assert idle.route("t", [0, 1, 2], [0, 0, 0], now=7) == 1
    assert idle.bound_per_rank() == {0: 2, 1: 2, 2: 2}


def test_bound_counts_follow_moves_expiry_and_the_cap():
    aff = SessionAffinity(overload_factor=1.5, max_bindings=3, ttl=10)
    aff.route("a", [0, 1], [0, 0], now=0)  # 0
    aff.route("b", [0, 1], [0, 0], now=1)  # 1
    aff.route("a", [0, 1], [1000, 0], now=2, cost=1)  # moved to 1
    assert aff.bound_per_rank() == {1: 2}
    aff.route("c", [0, 1], [0, 0], now=3)  # 0
    aff.route("d", [0, 1], [0, 0], now=4)  # cap: drops "b" (least recent)
    assert aff.rank_of("b") is None and sum(aff.bound_per_rank().values()) == 3
    aff.expire(100)
    assert aff.bound_per_rank() == {} and len(aff) == 0


def test_overload_guard_rebinds_to_least_loaded():
    aff = SessionAffinity(overload_factor=1.5)
    aff.route("a", [0, 1], [0, 0], now=0)  # -> 0
    # 1000 > 1.5 x the other's 100 and exceeds it by more than the request (100).
    assert aff.route("a", [0, 1], [1000, 100], now=1, cost=100) == 1
    assert aff.counters.rebound_overload == 1
    assert aff.route("a", [0, 1], [100, 120], now=2, cost=100) == 1  # stays


def test_overload_guard_needs_the_excess_to_beat_the_recompute():
    aff = SessionAffinity(overload_factor=1.5)
    aff.route("a", [0, 1], [0, 0], now=0)
    # Far above the mean in ratio, but moving would recompute more than it saves.
    assert aff.route("a", [0, 1], [900, 0], now=1, cost=1000) == 0
    assert aff.counters.rebound_overload == 0


def test_overload_guard_ignores_a_lightly_used_rank():
    aff = SessionAffinity(overload_factor=1.5, min_load=5000)
    aff.route("a", [0, 1], [0, 0], now=0)
    # One busy session on an otherwise idle server: not an overload.
    assert aff.route("a", [0, 1], [4000, 0], now=1, cost=100) == 0
    assert aff.route("a", [0, 1], [6000, 0], now=2, cost=100) == 1


def test_overload_factor_zero_turns_the_guard_off():
    aff = SessionAffinity(overload_factor=0)
    aff.route("a", [0, 1, 2, 3], [0, 0, 0, 0], now=0)
    assert aff.route("a", [0, 1, 2, 3], [10**9, 0, 0, 0], now=1) == 0


def test_inactive_rank_rebinds():
    aff = SessionAffinity()
    aff.route("a", [0, 1, 2], [0, 5, 5], now=0)
    assert aff.route("a", [1, 2], [0, 9, 3], now=1) == 2
    assert aff.counters.rebound_inactive == 1


def test_close_ends_the_binding():
    aff = SessionAffinity()
    aff.route("a", [0, 1], [0, 0], now=0)
    assert aff.close("a") and not aff.close("a") and not aff.close("never")
    assert aff.rank_of("a") is None and aff.counters.closed == 1
    assert aff.route("a", [0, 1], [9, 0], now=1) == 1  # bound anew
    assert aff.counters.bound == 2


def test_ttl_expires_idle_bindings_in_activity_order():
    aff = SessionAffinity(ttl=10)
    aff.route("a", [0, 1], [0, 0], now=0)
    aff.route("b", [0, 1], [5, 0], now=4)
    aff.route("a", [0, 1], [5, 5], now=8)  # activity keeps "a" alive
    assert aff.expire(13.9) == 0
    assert aff.expire(14) == 1 and aff.rank_of("b") is None and aff.rank_of("a") == 0
    assert aff.expire(18) == 1 and len(aff) == 0
    assert aff.counters.expired == 2


def test_a_sessions_own_timeout_sets_its_bindings_expiry():
    # /open_session with a timeout: the ranks expire that session by it, not
    # by the shared TTL, so its binding lasts exactly as long.
    aff = SessionAffinity(ttl=10)
    aff.open("long", 100.0)
    aff.open("short", 3.0)
    aff.route("long", [0, 1], [0, 0], now=0)
    aff.route("short", [0, 1], [0, 0], now=0)
    aff.route("plain", [0, 1], [0, 0], now=0)
    assert aff.timeout_of("long") == 100.0 and aff.timeout_of("plain") is None
    assert aff.expire(3) == 1 and aff.rank_of("short") is None
    assert aff.expire(10) == 1 and aff.rank_of("plain") is None
    aff.route("long", [0, 1], [0, 0], now=90)  # activity pushes its expiry on
    assert aff.expire(150) == 0 and aff.rank_of("long") is not None
    assert aff.expire(190) == 1 and len(aff) == 0 and aff.bound_per_rank() == {}
    assert aff.counters.expired == 3
    # Expired with its session on the ranks: the next turn reopens it under
    # the shared TTL there, and binds anew under it here.
    assert aff.timeout_of("long") is None
    aff.route("long", [0, 1], [0, 0], now=200)
    assert aff.expire(210) == 1


def test_a_timeout_applies_to_an_existing_binding_once_and_ends_on_close():
    aff = SessionAffinity(ttl=None)  # no shared TTL: only own timeouts expire
    aff.route("a", [0, 1], [0, 0], now=0)
    aff.open("a", 5.0)
    aff.open("a", 500.0)  # already open with a timeout: kept, like the ranks
    assert aff.timeout_of("a") == 5.0
    assert aff.expire(4) == 0 and aff.expire(5) == 1
    aff.open("b", 5.0)
    aff.route("b", [0, 1], [0, 0], now=10)
    assert aff.close("b") and aff.timeout_of("b") is None
    assert aff.expire(1e9) == 0  # its heap entry is stale, nothing double-counted
    aff.open("c", None)  # no timeout: nothing recorded
    aff.route("c", [0, 1], [0, 0], now=0)
    assert aff.expire(1e9) == 0 and aff.rank_of("c") is not None


def test_timed_bindings_share_the_cap_by_last_use_and_stay_bounded():
    aff = SessionAffinity(max_bindings=2)
    aff.open("t", 50.0)
    aff.route("t", [0, 1], [0, 0], now=0)
    aff.route("p", [0, 1], [0, 0], now=1)
    aff.route("q", [0, 1], [0, 0], now=2)  # the least recently routed goes: "t"
    assert aff.rank_of("t") is None and aff.timeout_of("t") is None
    assert aff.counters.evicted == 1 and len(aff) == 2
    # A classic session's binding is kept whatever its timeout.
    aff.open("k", 1.0)
    aff.route("k", [0, 1], [0, 0], now=3, keep=True)
    assert aff.is_kept("k") and aff.expire(100) == 0
    # Many short-lived timed sessions closed early: the heap does not grow
    # with them.
    big = SessionAffinity(max_bindings=10)
    for i in range(1000):
        big.open(f"s{i}", 1e6)
        big.route(f"s{i}", [0], [0], now=i)
        big.close(f"s{i}")
    assert len(big._due) <= 64 + 2 and len(big) == 0


def test_no_ttl_keeps_bindings():
    aff = SessionAffinity(ttl=None)
    aff.route("a", [0, 1], [0, 0], now=0)
    assert aff.expire(1e12) == 0 and aff.rank_of("a") == 0


def test_cap_drops_least_recently_routed():
    aff = SessionAffinity(max_bindings=2)
    aff.route("a", [0, 1], [0, 0], now=0)
    aff.route("b", [0, 1], [0, 0], now=1)
    aff.route("a", [0, 1], [0, 0], now=2)
    aff.route("c", [0, 1], [0, 0], now=3)  # drops "b", not "a"
    assert len(aff) == 2 and aff.rank_of("b") is None and aff.rank_of("a") is not None
    assert aff.counters.evicted == 1


def test_kept_bindings_never_move_for_load_nor_expire():
    aff = SessionAffinity(overload_factor=1.5, ttl=10)
    assert aff.route("classic", [0, 1], [0, 5], now=0, keep=True) == 0
    assert aff.route("plain", [0, 1], [5, 0], now=0) == 1
    # Rank 0 overloaded: the plain session would move, the kept one stays.
    assert aff.route("classic", [0, 1], [100, 1], now=5) == 0
    # Idle past the TTL: only the plain binding expires.
    aff.expire(now=100)
    assert aff.rank_of("plain") is None and aff.rank_of("classic") == 0
    assert aff.counters.expired == 1 and aff.counters.rebound_overload == 0
    # Its rank gone: the state went with it, the session moves.
    assert aff.route("classic", [1], [0, 0], now=101, keep=True) == 1
    assert aff.counters.rebound_inactive == 1
    assert aff.close("classic") and len(aff) == 0 and aff.bound_per_rank() == {}


def test_the_cap_drops_kept_bindings_last():
    aff = SessionAffinity(max_bindings=2)
    aff.route("k", [0, 1], [0, 0], now=0, keep=True)
    aff.route("p", [0, 1], [0, 0], now=1)
    aff.route("q", [0, 1], [0, 0], now=2)  # over the cap: "p" goes, not "k"
    assert aff.rank_of("k") is not None and aff.rank_of("p") is None
    assert aff.counters.evicted == 1 and len(aff) == 2
    # A plain binding that turns classic becomes kept.
    aff.route("q", [0, 1], [0, 0], now=3, keep=True)
    assert aff.is_kept("q")
    aff.route("r", [0, 1], [0, 0], now=4, keep=True)  # only kept ones left: oldest goes
    assert aff.rank_of("k") is None and len(aff) == 2
    assert sum(aff.bound_per_rank().values()) == 2
    # A cap full of kept bindings: a new plain session still gets its binding
    # (the oldest kept one goes, not the newcomer).
    aff.route("plain", [0, 1], [0, 0], now=5)
    assert aff.rank_of("plain") is not None and aff.rank_of("q") is None
    aff.follow("plain2", 1, now=6)
    assert aff.rank_of("plain2") == 1 and aff.rank_of("plain") is None and len(aff) == 2


def test_an_explicit_rank_moves_the_binding():
    aff = SessionAffinity()
    assert aff.route("a", [0, 1], [0, 0], now=0) == 0
    aff.follow("a", 1, now=1)
    assert aff.rank_of("a") == 1 and aff.counters.rebound_explicit == 1
    assert aff.route("a", [0, 1], [0, 0], now=2) == 1
    aff.follow("new", 0, now=3, keep=True)  # a first turn routed explicitly binds
    assert aff.rank_of("new") == 0 and aff.is_kept("new") and aff.counters.bound == 2
    assert aff.bound_per_rank() == {0: 1, 1: 1}


def test_route_without_active_ranks_raises():
    with pytest.raises(RuntimeError):
        SessionAffinity().route("a", [], [], now=0)
    with pytest.raises(ValueError):
        SessionAffinity(max_bindings=0)


def test_session_key():
    class R:
        session_id = None
        session_params = None

    r = R()
    assert session_key(r) is None
    r.session_id = "s"
    assert session_key(r) == "s"
    r.session_id = None

    class P:
        id = "classic"

    r.session_params = P()
    assert session_key(r) == "classic"
    r.session_params = None
    r.session_id = 17  # not a str: left to the configured method
    assert session_key(r) is None


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


def test_options_defaults_keywords_and_pickling():
    args = ServerArgs(model_path="dummy")
    assert args.disable_session_dp_affinity is False
    assert args.session_dp_affinity_overload_factor == 3.0
    assert args.session_dp_affinity_max_sessions == 100_000
    args = ServerArgs(model_path="dummy", disable_session_dp_affinity=True,
                      session_dp_affinity_overload_factor=3,
                      session_dp_affinity_max_sessions=7, session_radix_cache_ttl=5)
    back = pickle.loads(pickle.dumps(args))
    assert back.disable_session_dp_affinity is True
    assert back.session_dp_affinity_overload_factor == 3.0
    assert back.session_dp_affinity_max_sessions == 7
    assert back.session_radix_cache_ttl == 5.0  # the TTL's own option still works


@pytest.mark.parametrize("kw", [
    {"session_dp_affinity_overload_factor": 1.0},
    {"session_dp_affinity_overload_factor": -2},
    {"session_dp_affinity_overload_factor": float("nan")},
    {"session_dp_affinity_max_sessions": 0},
    {"session_dp_affinity_max_sessions": 2.5},
    {"disable_session_dp_affinity": "yes"},
])
def test_options_validation(kw):
    with pytest.raises(AffinityOptionError):
        ServerArgs(model_path="dummy", **kw)


def test_cli_flags():
    args = prepare_server_args([
        "--model-path", "dummy", "--dp-size", "2", "--enable-session-radix-cache",
        "--session-dp-affinity-overload-factor", "2.5",
        "--session-dp-affinity-max-sessions", "1000",
    ])
    assert args.session_dp_affinity_overload_factor == 2.5
    assert args.session_dp_affinity_max_sessions == 1000
    assert args.disable_session_dp_affinity is False
    assert affinity_wanted(args, "round_robin")
    off = prepare_server_args(["--model-path", "dummy", "--dp-size", "2",
                               "--enable-session-radix-cache",
                               "--disable-session-dp-affinity"])
    assert off.disable_session_dp_affinity is True and not affinity_wanted(off, "round_robin")
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "dummy",
                             "--session-dp-affinity-overload-factor", "0.5"])


def test_affinity_wanted_only_with_session_cache_and_dp():
    def args(**kw):
        base = dict(enable_session_radix_cache=True, dp_size=2,
                    disable_session_dp_affinity=False)
        base.update(kw)
        return type("A", (), base)()

    rr = "round_robin"
    assert affinity_wanted(args(), rr)
    assert affinity_wanted(args(), "total_tokens")
    assert affinity_wanted(args(), "total_requests")
    assert not affinity_wanted(args(enable_session_radix_cache=False), rr)
    assert not affinity_wanted(args(dp_size=1), rr)
    assert not affinity_wanted(args(disable_session_dp_affinity=True), rr)
    assert not affinity_wanted(args(), "follow_bootstrap_room")


# ---------------------------------------------------------------------------
# The real DataParallelController in its own spawned process
# ---------------------------------------------------------------------------


class ControllerHandle:
    def __init__(self, server_args, port_args, to_ctrl, collector):
        self.server_args = server_args
        self.port_args = port_args
        self.to_ctrl = to_ctrl
        self.collector = collector
        self._seen: dict = {}
        self._writers: dict = {}
        self._n = 0

    def send(self, msg) -> None:
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.to_ctrl, msg)

    def generate(self, session_id=None, n_tokens=8, routed_dp_rank=None, classic=None):
        from sglang.srt.managers.io_struct import SessionParams, TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._n += 1
        rid = f"r{self._n}"
        self.send(TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array.array("i", range(n_tokens)),
            input_embeds=None, mm_inputs=None, token_type_ids=None,
            sampling_params=SamplingParams(max_new_tokens=1), return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
            stream=False, session_id=session_id, routed_dp_rank=routed_dp_rank,
            session_params=SessionParams(id=classic) if classic else None,
        ))
        return self.rank_of(rid)

    def close(self, session_id) -> list:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        self._n += 1
        rid = f"c{self._n}"
        self.send(CloseSessionReqInput(rid=rid, session_id=session_id))
        return sorted(self.ranks_of(rid, 2))

    def open(self, session_id, timeout=None) -> list:
        from sglang.srt.managers.io_struct import OpenSessionReqInput

        self._n += 1
        rid = f"o{self._n}"
        self.send(OpenSessionReqInput(rid=rid, capacity_of_str_len=1024,
                                      session_id=session_id, timeout=timeout))
        return sorted(self.ranks_of(rid, 2))

    def rank_of(self, rid: str) -> int:
        return self.ranks_of(rid, 1)[0]

    def ranks_of(self, rid: str, n: int, timeout: float = 60.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self._seen.get(rid, ())) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"{rid}: not delivered to {n} rank(s) in {timeout}s"
            if self.collector.poll(int(left * 1000)):
                m = self.collector.recv_pyobj()
                self._seen.setdefault(m["rid"], []).append(m["dp_rank"])
        return self._seen[rid]

    def set_loads(self, tokens: list) -> None:
        """Publish per-rank load snapshots through SGLang's SHM writer, as the
        schedulers do; the controller reads at most every 20 ms."""
        from sglang.srt.managers.load_snapshot import (
            LoadSnapshot, ShmLoadSnapshotWriter, shm_path_for)

        for rank, n in enumerate(tokens):
            w = self._writers.get(rank)
            if w is None:
                w = self._writers[rank] = ShmLoadSnapshotWriter(
                    shm_path_for(self.port_args.instance_id), len(tokens), rank)
            w.write(LoadSnapshot(timestamp=time.time(), dp_rank=rank,
                                 num_total_tokens=n, num_running_reqs=1))
        time.sleep(0.05)

    def cleanup(self) -> None:
        from sglang.srt.managers.load_snapshot import shm_path_for

        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path_for(self.port_args.instance_id))


class _Launch:
    """One real DataParallelController process and its tokenizer-side sockets."""

    def __init__(self, zctx, tmp_dir, name, **server_kw):
        from sglang.srt.utils.network import get_zmq_socket

        import zmq

        self.server_args = ServerArgs(
            model_path="dummy", dp_size=2, enable_session_radix_cache=True,
            load_balance_method="round_robin", **server_kw)
        self.port_args = PortArgs.init_new(self.server_args)
        collector = zctx.socket(zmq.PULL)
        addr = f"ipc://{tmp_dir}/collector-{name}"
        collector.bind(addr)
        to_ctrl = get_zmq_socket(zctx, zmq.PUSH, self.port_args.scheduler_input_ipc_name, True)
        self.handle = ControllerHandle(self.server_args, self.port_args, to_ctrl, collector)
        # Spawned like SGLang spawns it; the stand-ins read the collector
        # address from the environment they inherit.
        os.environ[COLLECTOR_ENV] = addr
        ctx = mp.get_context("spawn")
        self.reader, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_controller_forking_stand_ins,
                                args=(self.server_args, self.port_args, writer))
        self.proc.start()

    def wait_ready(self) -> None:
        assert self.reader.poll(300), "DP controller did not report ready"
        info = self.reader.recv()
        assert info["status"] == "ready" and len(info["scheduler_pids"]) == 2

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.handle.cleanup()


@pytest.fixture(scope="module")
def controllers(tmp_path_factory):
    """Two real controllers started at once: affinity on (overload factor 1.5)
    and affinity off (stock round robin)."""
    import zmq

    tmp_dir = tmp_path_factory.mktemp("dp")
    zctx = zmq.Context()
    old_env = os.environ.get(COLLECTOR_ENV)
    # On an exception the controller SIGQUITs its parent (this process): record it.
    quits = []
    old_quit = signal.signal(signal.SIGQUIT, lambda *_: quits.append(1))
    launches = {}
    try:
        launches["on"] = _Launch(zctx, tmp_dir, "on", session_dp_affinity_overload_factor=1.5)
        launches["off"] = _Launch(zctx, tmp_dir, "off", disable_session_dp_affinity=True)
        for launch in launches.values():
            launch.wait_ready()
        yield {k: v.handle for k, v in launches.items()}
        assert not quits, "a DP controller hit an exception"
        for k, launch in launches.items():
            assert launch.proc.is_alive(), f"DP controller {k!r} died"
    finally:
        for launch in launches.values():
            launch.stop()
        signal.signal(signal.SIGQUIT, old_quit)
        if old_env is None:
            os.environ.pop(COLLECTOR_ENV, None)
        else:
            os.environ[COLLECTOR_ENV] = old_env
        zctx.destroy(linger=0)


@pytest.fixture(scope="module")
def affinity_controller(controllers):
    return controllers["on"]


@pytest.fixture(scope="module")
def stock_controller(controllers):
    return controllers["off"]


def test_real_controller_session_affinity(affinity_controller):
    h = affinity_controller
    # Session-less requests keep round robin.
    assert [h.generate() for _ in range(4)] == [0, 1, 0, 1]
    # A session stays on its first rank, turn after turn.
    a = h.generate("a", n_tokens=64)
    assert [h.generate("a", n_tokens=64) for _ in range(4)] == [a] * 4
    # The next new session binds to the least-loaded rank (the controller's
    # budget counted a's tokens on its rank).
    b = h.generate("b")
    assert b != a
    assert [h.generate("b") for _ in range(3)] == [b] * 3
    # Sessions do not disturb the round-robin counter of session-less traffic.
    assert [h.generate() for _ in range(2)] == [0, 1]
    # An explicit routed_dp_rank wins, and the binding follows it (that
    # turn's KV is there now).
    assert h.generate("a", routed_dp_rank=b) == b
    assert h.generate("a") == b
    assert h.generate("a", routed_dp_rank=a) == a
    assert h.generate("a") == a
    # Classic sessions (session_params.id) stick as well.
    c = h.generate(classic="classic-1")
    assert [h.generate(classic="classic-1") for _ in range(3)] == [c] * 3


def test_real_controller_close_and_overload(affinity_controller):
    h = affinity_controller
    h.set_loads([1000, 1000])  # overwrites the budget's speculative counts
    s = h.generate("s")
    other = 1 - s
    loads = [0, 0]
    loads[s], loads[other] = 30_000, 800  # s's rank far heavier, but not busy
    h.set_loads(loads)
    assert h.generate("s") == s
    # /close_session still reaches every rank, and ends the binding: the next
    # turn binds to the least-loaded rank.
    assert h.close("s") == [0, 1]
    assert h.generate("s") == other
    # Overload guard: the bound rank far above the mean, and busy (over half
    # of its KV capacity, 65536 tokens in the stand-in) -> moved.
    loads[other], loads[s] = 50_000, 800
    h.set_loads(loads)
    assert h.generate("s") == s
    assert h.generate("s") == s
    # A classic session is never moved by the guard: its next turn needs the
    # state only its rank holds.
    h.set_loads([1000, 1000])
    c = h.generate(classic="classic-2")
    loads = [0, 0]
    loads[c], loads[1 - c] = 50_000, 800
    h.set_loads(loads)
    assert [h.generate(classic="classic-2") for _ in range(2)] == [c, c]


def test_real_controller_open_timeout_ends_the_binding(affinity_controller):
    h = affinity_controller
    # /open_session still reaches every rank; its timeout (0.5 s, no server
    # TTL here) becomes the binding's.
    assert h.open("timed", timeout=0.5) == [0, 1]
    assert h.open("untimed") == [0, 1]
    h.set_loads([1000, 1000])
    t, u = h.generate("timed"), h.generate("untimed")
    loads = [0, 0]
    loads[t] = 5000  # heavier, not busy: a live binding stays
    h.set_loads(loads)
    assert h.generate("timed") == t
    time.sleep(0.7)
    # Idle past its own timeout: the binding ended, and the next turn goes
    # back to the rank that served it (its KV is there), heavier but not
    # overloaded ...
    assert h.generate("timed") == t
    time.sleep(0.7)
    # ... and, ended again with that rank now busy and overloaded, to the
    # lighter one.
    loads[t] = 50_000
    h.set_loads(loads)
    assert h.generate("timed") == 1 - t
    loads = [0, 0]
    loads[u] = 5000
    h.set_loads(loads)
    assert h.generate("untimed") == u  # no timeout, no TTL: still bound


def test_real_controller_affinity_disabled_is_stock_round_robin(stock_controller):
    h = stock_controller
    assert [h.generate("a") for _ in range(4)] == [0, 1, 0, 1]
    assert h.close("a") == [0, 1]
    assert h.open("a", timeout=1.0) == [0, 1]


def test_a_session_whose_binding_expired_goes_back_to_its_rank():
    # The ranks count idle time from a turn's finish, the binding from its
    # routing: a long turn can end the binding while the rank still holds the
    # session's KV, so its next turn goes back there (unless overloaded).
    aff = SessionAffinity(ttl=60.0)
    assert aff.route("agent", [0, 1], [0, 0], now=0.0, cost=100) == 0
    assert aff.route("other", [0, 1], [0, 0], now=0.0, cost=100) == 1
    assert aff.expire(70.0) == 2 and len(aff) == 0
    # Rank 0 now busier than rank 1, but not overloaded: back to rank 0.
    assert aff.route("agent", [0, 1], [5, 0], now=70.0, cost=100) == 0
    assert aff.counters.resumed == 1 and aff.counters.bound == 2
    assert aff.bound_per_rank() == {0: 1}
    # Overloaded or gone: bound anew to the least-loaded rank.
    assert aff.route("other", [0], [9, 0], now=71.0, cost=100) == 0
    assert aff.counters.resumed == 1 and aff.counters.bound == 3
    aff.expire(1000.0)
    assert aff.route("agent", [0, 1], [500, 0], now=1000.0, cost=100) == 1
    assert aff.counters.resumed == 1 and aff.counters.bound == 4


def test_expired_ranks_are_forgotten_on_close_and_bounded():
    aff = SessionAffinity(ttl=10.0, max_bindings=3)
    aff.route("a", [0, 1], [0, 0], now=0)
    aff.expire(20)
    assert aff.close("a") is False  # no binding; its hint goes too
    # Rank 0 busier but not overloaded (the move would cost 100): only the
    # hint, dropped with the close, could send it back there.
    assert aff.route("a", [0, 1], [1, 0], now=21, cost=100) == 1
    assert aff.counters.resumed == 0
    for i in range(10):
        aff.route(f"s{i}", [0, 1], [0, 0], now=30 + i)
        aff.expire(100 + i)
    assert len(aff._expired_rank) <= 3
