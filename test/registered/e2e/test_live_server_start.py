"""The E2E launcher without SGLang: port-clash handling (a fake "python"
that reports a bind failure and keeps running, as SGLang's parent does when
a DP worker's port is taken: it waits for the worker forever), stopping
several servers together, and the flags every server gets."""

import stat
import textwrap
import time

import pytest

from sglang_session_cache_bench.live_server import (PORT_CLASH_RETRIES, LaunchedServer,
                                                      ServerStartError, free_port, stop_all)


def _fake_python(tmp_path, starts_file):
    script = tmp_path / "fake-python"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo start >> {starts_file}
        echo "OSError: [Errno 98] Address already in use"
        exec sleep 120
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_clash_in_a_live_server_is_retried_on_fresh_ports_then_reported(tmp_path):
    starts = tmp_path / "starts"
    server = LaunchedServer("/no/model", python=str(_fake_python(tmp_path, starts)),
                            name="fake", log_path=tmp_path / "fake.log")
    first_port = server.port
    ports = []
    real_start = server.start

    def start():
        ports.append(server.port)
        return real_start()

    server.start = start
    try:
        with pytest.raises(ServerStartError, match="could not bind a port"):
            server.wait_ready(timeout=60)  # fails fast, not after the timeout
    finally:
        server.stop()
    assert starts.read_text().count("start") == 1 + PORT_CLASH_RETRIES
    assert ports[0] == first_port and len(set(ports)) == len(ports)
    assert not server.alive()  # every attempt's process group was stopped


def test_a_port_the_caller_chose_is_never_changed(tmp_path):
    starts = tmp_path / "starts"
    server = LaunchedServer("/no/model", python=str(_fake_python(tmp_path, starts)),
                            name="fake", port=1, log_path=tmp_path / "fake.log")
    with pytest.raises(ServerStartError, match="could not bind a port"):
        server.wait_ready(timeout=60)
    assert server.port == 1 and starts.read_text().count("start") == 1
    assert not server.alive()


def test_a_port_is_never_handed_out_twice():
    # The kernel may hand back a port nothing bound yet (the fake above never
    # binds), which once made a clash retry land on the port it had tried.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def _slow_to_stop(tmp_path, name, events, on_term):
    """A fake "python" that logs when SIGTERM arrives, then ``on_term`` (a
    shell command) before exiting, as an SGLang server takes seconds to."""
    script = tmp_path / f"fake-{name}"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        trap 'echo term {name} >> {events}; {on_term}; echo exit {name} >> {events}; exit 0' TERM
        echo ready >> {events}.{name}
        while :; do sleep 0.1; done
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return LaunchedServer("/no/model", python=str(script), name=name,
                          log_path=tmp_path / f"{name}.log")


def _wait_started(servers, events):
    for s in servers:
        s.start()
    for s in servers:
        ready = events.parent / f"{events.name}.{s.name}"
        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists(), f"{s.name} did not start"


def test_stop_all_overlaps_the_shutdowns(tmp_path):
    # Every server hears SIGTERM before any shutdown is waited for: the E2E
    # modules stop two to four servers that take seconds each to exit.
    events = tmp_path / "events"
    servers = [_slow_to_stop(tmp_path, n, events, "sleep 2") for n in ("a", "b")]
    _wait_started(servers, events)
    stop_all(servers)
    lines = events.read_text().split()
    order = lines[::2]  # "term a", "term b", "exit a", ... -> the events
    assert order[:2] == ["term", "term"] and order[2:] == ["exit", "exit"], lines
    assert not any(s.alive() for s in servers)


def test_stop_all_kills_what_ignores_sigterm(tmp_path):
    events = tmp_path / "events"
    stubborn = _slow_to_stop(tmp_path, "stubborn", events, "sleep 120")
    never_started = LaunchedServer("/no/model", name="never", log_path=tmp_path / "n.log")
    _wait_started([stubborn], events)
    stop_all([stubborn, never_started], timeout=0.5)
    assert not stubborn.alive() and stubborn.proc.returncode == -9
    assert never_started.proc is None
    assert "exit" not in events.read_text()


def test_servers_sleep_when_idle_unless_asked_not_to(tmp_path):
    # An idle CPU scheduler busy-polls a whole core without the flag, which
    # starved the server under test next to the ones a module keeps waiting.
    asleep = LaunchedServer("/no/model", port=1, log_path=tmp_path / "a.log")
    awake = LaunchedServer("/no/model", port=1, log_path=tmp_path / "b.log", sleep_on_idle=False)
    assert "--sleep-on-idle" in asleep.command("/no/model")
    assert "--sleep-on-idle" not in awake.command("/no/model")
