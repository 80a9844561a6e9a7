"""`memgate serve --workers N`: N worker processes, each with its own event loop, on one port.

One event loop uses one core; the request path is CPU work (parse, plan, log), so a
bigger machine needs more processes. Each worker is `memgate serve` itself, started
with a hidden `--worker K`: it loads and watches the config, binds the port with
SO_REUSEPORT and drains on SIGTERM exactly as a single gateway does. The kernel spreads
new connections over the workers' listening sockets.

The parent accepts nothing. It holds a bound, never listening, SO_REUSEPORT socket on
the port: a port already taken fails here, before any worker starts, and port 0 becomes
one real port that every worker shares. It gives the workers a private metrics directory
(PROMETHEUS_MULTIPROC_DIR, see metrics.py), forwards SIGTERM/SIGINT (drain) and SIGHUP
(reload), and restarts a worker that exits: after 0.5 s, doubling per quick failure up
to 10 s; a worker that fails 5 times in a row within 10 s of its start is a crash loop,
and the parent then stops the others and exits 1. Each worker touches a heartbeat file
every second from its event loop; one silent for `hang_s` (30 s: stopped, or its loop
stuck) is killed, logged `worker_hung`, and restarted like one that exited. A worker is
not restarted while the config file does not load (the running workers keep serving the
last good one); and a worker whose parent is gone drains and exits by itself.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MAX_WORKERS = 64
_DIR_PREFIX = "memgate-metrics-"


def parse_workers(text: str) -> int:
    """`auto` (the CPUs this process may use) or a count from 1 to MAX_WORKERS."""
    if text.strip().lower() == "auto":
        return min(available_cpus(), MAX_WORKERS)
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"workers must be a number or 'auto', not {text!r}") from None
    if not 1 <= n <= MAX_WORKERS:
        raise ValueError(f"workers must be 1 to {MAX_WORKERS}, not {n}")
    return n


def available_cpus() -> int:
    """CPUs this process may run on, capped by a cgroup v2 CPU quota (a container with
    `cpus: 2` on a 64-core host gets 2 workers, not 64)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def reserve_port(host: str, port: int) -> socket.socket | None:
    """A bound SO_REUSEPORT socket on (host, port) that never listens, or None when the OS
    has no SO_REUSEPORT. Raises OSError when the port is taken."""
    reuse = getattr(socket, "SO_REUSEPORT", None)
    if reuse is None:
        return None
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
    except OSError:  # defined but refused (some emulated kernels)
        sock.close()
        return None
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def metrics_base() -> Path:
    """Where the metric files go: $TMPDIR if set, else /dev/shm when writable (memory:
    every request writes them, and dirty pages of a disk-backed file cost writeback),
    else the system's temp dir."""
    shm = Path("/dev/shm")
    if not os.environ.get("TMPDIR") and shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def metrics_dir() -> Path:
    """A fresh private directory for the workers' metric files; left-overs of gateways
    that are gone (killed before they could remove theirs) are removed first."""
    tmp = metrics_base()
    for old in tmp.glob(f"{_DIR_PREFIX}*"):
        try:
            pid = int(old.name[len(_DIR_PREFIX):].split("-", 1)[0])
            if old.stat().st_uid != os.getuid():
                continue
            if pid != os.getpid():
                os.kill(pid, 0)
                continue  # that gateway still runs
        except ProcessLookupError:
            pass
        except (ValueError, OSError):
            continue
        shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=tmp))


def heartbeat_file(shared_dir: str | Path, index: int) -> Path:
    """The file worker `index` touches every second from its event loop (in the workers'
    private directory, beside the metric files)."""
    return Path(shared_dir) / f"heartbeat-{index}"


def watch_parent(stop: asyncio.Event, index: int, interval_s: float = 1.0
                 ) -> asyncio.Task[None]:
    """Set `stop` once this worker's parent is gone (no orphan keeps the port), and touch
    the worker's heartbeat file meanwhile: a loop that stops turning stops touching it."""
    parent = os.getppid()
    shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    beat = heartbeat_file(shared, index) if shared else None

    async def watch() -> None:
        while True:
            if os.getppid() != parent:
                stop.set()
            if beat is not None:
                try:
                    beat.touch()
                except OSError:  # the directory is the parent's: gone with it
                    pass
            await asyncio.sleep(interval_s)

    return asyncio.create_task(watch())


class Supervisor:
    """Keeps N worker processes running until SIGTERM/SIGINT, then drains them."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        n: int,
        env: Mapping[str, str],
        log: Any,
        drain_s: float = 30.0,
        can_start: Callable[[], bool] = lambda: True,
        on_exit: Callable[[int], None] = lambda _pid: None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        stable_s: float = 10.0,
        max_failures: int = 5,
        beats: Path | None = None,
        hang_s: float = 30.0,
    ) -> None:
        self.command = command
        self.n = n
        self.env = dict(env)
        self.log = log
        self.drain_s = drain_s
        self.can_start = can_start
        self.on_exit = on_exit
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.max_failures = max_failures
        self.beats = beats  # where the workers' heartbeat files are (None: not watched)
        self.hang_s = hang_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.crashed = False
        self._stop = asyncio.Event()

    async def run(self) -> int:
        """0 after a drain on SIGTERM/SIGINT, 1 after a crash loop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        keepers = [asyncio.create_task(self._keep(i)) for i in range(self.n)]
        try:
            await self._stop.wait()
            self.log.info("shutting_down", workers=len(self.procs), drain_s=self.drain_s)
            self._signal_all(signal.SIGTERM)
            # a worker drains for drain_s, then flushes captures and archives
            done, _ = await asyncio.wait(keepers, timeout=self.drain_s + 15)
            if len(done) < len(keepers):
                self._signal_all(signal.SIGKILL)
                await asyncio.gather(*keepers, return_exceptions=True)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        return 1 if self.crashed else 0

    def stop(self) -> None:
        """Drain every worker and return from run() (what SIGTERM does)."""
        self._stop.set()

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _keep(self, index: int) -> None:
        failures = 0
        refused = False
        while not self._stop.is_set():
            if not self.can_start():  # logged once per spell; the others keep serving
                if not refused:
                    self.log.error("worker_not_started", worker=index,
                                   reason="the config does not load", retry_s=self.backoff_s)
                refused = True
                await self._pause(self.backoff_s)
                continue
            refused = False
            proc = await asyncio.create_subprocess_exec(*self.command(index), env=self.env)
            self.procs[index] = proc
            if self._stop.is_set():  # started while the others were told to stop
                proc.terminate()
            started = time.monotonic()
            self.log.info("worker_started", worker=index, pid=proc.pid)
            code = await self._wait(index, proc)
            self.on_exit(proc.pid)
            uptime = time.monotonic() - started
            if self._stop.is_set():
                self.log.info("worker_stopped", worker=index, pid=proc.pid, code=code)
                return
            failures = failures + 1 if uptime < self.stable_s else 1
            if failures >= self.max_failures:
                self.log.error("workers_crash_loop", worker=index, pid=proc.pid, code=code,
                               failures=failures, within_s=self.stable_s)
                self.crashed = True
                self._stop.set()
                return
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
            self.log.error("worker_exited", worker=index, pid=proc.pid, code=code,
                           uptime_s=round(uptime, 1), restart_in_s=delay)
            await self._pause(delay)


    async def _wait(self, index: int, proc: asyncio.subprocess.Process) -> int:
        """The worker's exit code; one whose heartbeat is older than hang_s (stopped, or
        its event loop stuck) is killed first, and logged."""
        if self.beats is None:
            return await proc.wait()
        beat = heartbeat_file(self.beats, index)
        since = time.time()  # a worker starting up has not beaten yet
        tick = min(1.0, self.hang_s / 3)
        looked = time.monotonic()
        while True:
            try:
                return await asyncio.wait_for(proc.wait(), tick)
            except TimeoutError:
                pass
            now = time.monotonic()
            if now - looked > self.hang_s / 2:  # this process was not running either (the
                since = time.time()  # group paused, a VM stopped): silence counts from now
            looked = now
            try:
                last = max(since, beat.stat().st_mtime)
            except OSError:
                last = since
            if time.time() - last > self.hang_s and not self._stop.is_set():
                self.log.error("worker_hung", worker=index, pid=proc.pid,
                               silent_s=round(time.time() - last, 1), action="killed")
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                return await proc.wait()


def child_env(shared_dir: Path) -> dict[str, str]:
    """The workers' environment: the parent's, this package first on the path (a worker
    runs the code its parent runs) and the shared metrics directory."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding gateway/
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared_dir),
            "PYTHONPATH": root + (os.pathsep + path if path else "")}


def supervise(reserved: socket.socket, command: Callable[[int], list[str]], n: int,
              log: Any, drain_s: float, can_start: Callable[[], bool],
              hang_s: float = 30.0) -> int:
    """Run `n` workers on the port `reserved` holds (see reserve_port) until SIGTERM; one
    whose event loop has not turned for `hang_s` is killed and restarted."""
    from prometheus_client import multiprocess

    try:
        shared = metrics_dir()
    except OSError as exc:  # a read-only root filesystem without a writable TMPDIR
        log.error("workers_not_started", reason=f"no writable temporary directory: {exc}")
        reserved.close()
        return 2
    try:
        host, port = reserved.getsockname()[:2]
        log.info("workers", n=n, host=host, port=port)
        sup = Supervisor(lambda i: [*command(i), "--port", str(port)], n, child_env(shared),
                         log, drain_s, can_start,
                         on_exit=lambda pid: multiprocess.mark_process_dead(  # type: ignore[no-untyped-call]
                             pid, str(shared)),
                         beats=shared, hang_s=hang_s)
        code = asyncio.run(sup.run())
        log.info("stopped", code=code)
        return code
    finally:
        reserved.close()
        shutil.rmtree(shared, ignore_errors=True)
