"""Launch a real ``python -m sglang.launch_server`` on CPU and stop it cleanly.

    from sglang_session_cache_bench.live_server import LaunchedServer, build_tiny_model

    model = build_tiny_model("llama")            # or "mellum" (FULL+SWA)
    with LaunchedServer(model, session_cache=True) as srv:
        srv.wait_ready()
        requests.post(srv.url + "/generate", json={...})
        print(srv.log_text())

The server runs with ``--device cpu --attention-backend torch_native
--disable-cuda-graph --max-total-tokens N --sleep-on-idle`` (``SGLANG_USE_CPU_ENGINE`` is never
set: with no platform detected SGLang's ops fall back to plain torch). It runs
in its own process group (``start_new_session``), so ``stop()`` ends the HTTP
server, tokenizer manager, scheduler and detokenizer together by group id. Its
stdout+stderr go to a log file that outlives the server (``log_text()``).

Several servers start in parallel: construct them, call ``start()`` on each,
then ``wait_ready()`` on each (``start_all`` does exactly that).

Test-only helpers from the repository's ``test/`` directory are put on the
server's ``PYTHONPATH`` when needed: ``test/stand_ins`` (an import stand-in for
``vllm._custom_ops``) only when ``vllm`` is not importable, and
``test/workarounds/torch_native_swa`` when ``swa_index_workaround=True`` (an
upstream 0.5.16 torch_native bug, see ``test/workarounds/README.md``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from sglang_session_cache_bench.tiny_models import KINDS, build_tiny_model

UNIFIED_ENV = "SGLANG_ENABLE_UNIFIED_RADIX_TREE"
TEST_DIR_ENV = "SGLANG_SESSION_CACHE_TEST_DIR"
DEFAULT_MAX_TOTAL_TOKENS = 4096
DEFAULT_STARTUP_TIMEOUT_S = 300.0


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


PORT_CLASH_RETRIES = 2
_PORT_CLASH = "address already in use"  # uvicorn, ZMQ and torch all say it


_HANDED_OUT: set = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: the kernel
    may give back a port nothing has bound yet, so two servers (or a router
    and its metrics port, or a retry after a clash) could otherwise share one."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def find_test_dir() -> Optional[Path]:
    """The repository's ``test/`` directory (env override, then upwards from
    this file and from the working directory)."""
    env = os.environ.get(TEST_DIR_ENV)
    if env:
        return Path(env)
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in (start, *start.parents):
            cand = parent / "test" / "stand_ins"
            if cand.is_dir():
                return cand.parent
    return None


def helper_paths(swa_index_workaround: bool) -> List[str]:
    """Test-only ``PYTHONPATH`` entries this machine needs (see module doc)."""
    need_vllm = importlib.util.find_spec("vllm") is None
    if not (need_vllm or swa_index_workaround):
        return []
    test_dir = find_test_dir()
    if test_dir is None:
        raise ServerStartError(
            "the repository's test/ directory was not found (needed for the "
            f"vllm stand-in / SWA workaround); set {TEST_DIR_ENV}=<repo>/test"
        )
    paths = []
    if need_vllm:
        paths.append(str(test_dir / "stand_ins"))
    if swa_index_workaround:
        paths.append(str(test_dir / "workarounds" / "torch_native_swa"))
    return paths


class LaunchedServer:
    """One SGLang HTTP server process group.

    ``model``: a model directory or a tiny-model kind (``"llama"``, ``"mellum"``).
    ``session_cache``: pass ``--enable-session-radix-cache``.
    ``unified``: set ``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1`` (``False`` leaves it unset).
    ``extra_args``: more CLI arguments; ``env``: more environment variables.
    ``sleep_on_idle``: pass SGLang's ``--sleep-on-idle``.  On CPU an idle
    scheduler otherwise polls its sockets in a busy loop and holds a whole core
    (measured: 10 s of CPU in 10 s idle; with the flag, none), so the servers
    a test module or a benchmark keeps waiting starve the one at work on a
    small box.  The flag only makes an idle scheduler block on its sockets
    (at most 1 s, woken by any request).
    """

    def __init__(
        self,
        model: str,
        *,
        session_cache: bool = True,
        unified: bool = True,
        max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
        extra_args: Sequence[str] = (),
        env: Optional[Dict[str, str]] = None,
        swa_index_workaround: Optional[bool] = None,
        port: Optional[int] = None,
        log_path: Optional[os.PathLike] = None,
        python: str = sys.executable,
        name: Optional[str] = None,
        sleep_on_idle: bool = True,
    ):
        self.kind = model if model in KINDS else None
        self.model = model
        if swa_index_workaround is None:
            swa_index_workaround = self.kind == "mellum"
        self.swa_index_workaround = swa_index_workaround
        self.session_cache = session_cache
        self.unified = unified
        self.max_total_tokens = max_total_tokens
        self.extra_args = list(extra_args)
        self.sleep_on_idle = sleep_on_idle
        self.extra_env = dict(env or {})
        self.port = port or free_port()
        # Ports we picked ourselves may be taken between the pick and the bind
        # (ours, or the NCCL port SGLang picks the same way): such a start is
        # retried on fresh ports. A port the caller chose is never changed.
        self._port_retries = 0 if port else PORT_CLASH_RETRIES
        self.python = python
        self.name = name or f"{self.kind or 'model'}-{'on' if session_cache else 'off'}"
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"sglang-{self.name}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: Optional[subprocess.Popen] = None
        self.started_at: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, model_path: str) -> List[str]:
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--disable-cuda-graph",
            "--max-total-tokens", str(self.max_total_tokens),
        ]
        if self.session_cache:
            cmd.append("--enable-session-radix-cache")
        if self.sleep_on_idle:
            cmd.append("--sleep-on-idle")
        return cmd + self.extra_args

    def environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.pop("SGLANG_USE_CPU_ENGINE", None)  # the plain-torch fallback path
        env.pop(UNIFIED_ENV, None)
        if self.unified:
            env[UNIFIED_ENV] = "1"
        extra = helper_paths(self.swa_index_workaround)
        if extra:
            old = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join(extra + ([old] if old else []))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.extra_env)
        return env

    def start(self) -> "LaunchedServer":
        if self.proc is not None:
            return self
        model_path = str(build_tiny_model(self.kind)) if self.kind else self.model
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(model_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() ends all of it
            )
        self.started_at = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> "LaunchedServer":
        """Block until ``/health`` answers 200; raise ``ServerStartError`` if the
        server exits first or ``timeout`` passes."""
        import urllib.error
        import urllib.request

        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self.alive()
            # A clash in a child (a DP worker's ZMQ or NCCL port) leaves the
            # parent waiting forever, so the log is read while it is alive too.
            clash = _PORT_CLASH in self.log_text().lower()
            if clash and self._port_retries:
                self._port_retries -= 1
                sys.stderr.write(f"[live_server] {self.name}: port {self.port} (or one "
                                 "SGLang picked) was taken; restarting on a fresh port\n")
                self.stop()
                self.proc, self.port = None, free_port()
                self.start()
                deadline = time.monotonic() + timeout
                continue
            if not alive or clash:
                self.stop()
                if alive:
                    status = "could not bind a port"
                else:
                    status = f"exited with status {self.proc.returncode}"
                raise ServerStartError(f"{self.name}: server {status}\n" + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(f"{self.name}: not healthy after {timeout:.0f}s\n" + self.log_tail())

    def wait_exit(self, timeout: float) -> Optional[int]:
        """For launches expected to fail: the exit status, or ``None`` if still running."""
        self.start()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 80) -> str:
        lines = self.log_text().splitlines()
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
        stop_all([self], timeout)

    def __enter__(self) -> "LaunchedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(proc: subprocess.Popen, sig) -> bool:
    """Send ``sig`` to ``proc``'s process group; False once it is gone."""
    try:
        os.killpg(proc.pid, sig)  # group leader: start_new_session made pgid == pid
    except ProcessLookupError:
        return False
    return True


def stop_process_groups(procs: Iterable[subprocess.Popen], timeout: float = 20.0) -> None:
    """Stop the process groups led by ``procs`` (each started with
    ``start_new_session``) together: every group gets SIGTERM before any is
    waited for, so their shutdowns (seconds each) overlap; SIGKILL what is
    left after ``timeout``."""
    procs = list(procs)
    live = procs
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        live = [p for p in live if _signal_group(p, sig)]
        end = time.monotonic() + wait
        while live and time.monotonic() < end:
            time.sleep(0.2)
            live = [p for p in live if p.poll() is None or _group_alive(p.pid)]
        if not live:
            break
    for p in procs:
        if p.poll() is None:
            p.wait(timeout=5)


def stop_all(servers: Iterable[LaunchedServer], timeout: float = 20.0) -> None:
    """Stop several servers together (``stop_process_groups``)."""
    stop_process_groups([s.proc for s in servers if s.proc is not None], timeout)


def start_all(servers: Iterable[LaunchedServer], timeout: float = DEFAULT_STARTUP_TIMEOUT_S):
    """Start every server at once, then wait for each; on failure stop them all."""
    servers = list(servers)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def flush_cache(url: str, wait_s: float = 60.0) -> tuple:
    """POST the server's ``/flush_cache``; returns ``(status, body)`` (200:
    flushed).  SGLang refuses a flush while any request is still in the
    scheduler, and a finished request can sit in its last batch for a step
    after its HTTP reply; ``timeout`` makes the scheduler wait up to
    ``wait_s`` for idle instead of failing at once."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{url}/flush_cache?timeout={wait_s:g}", data=b"",
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=wait_s + 30) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


__all__ = [
    "LaunchedServer",
    "ServerStartError",
    "build_tiny_model",
    "find_test_dir",
    "flush_cache",
    "free_port",
    "helper_paths",
    "start_all",
]
