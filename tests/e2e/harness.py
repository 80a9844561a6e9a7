"""The agent-CLI end-to-end harness: install the pinned clients, write a scratch project,
run memgate (`memgate serve`, a process of its own) between a client and the mock model,
with a recording TCP tap on each side of it (tests/e2e/report.py reads what they kept).

    client ──► tap "client" ──► memgate serve ──► tap "upstream" ──► MockModel
                 (raw bytes)      ([mem] lines)      (raw bytes)       (parsed, answers)

The taps copy bytes both ways unchanged and keep what went towards memgate / the mock, so
"what the client sent" and "what reached the model" are both taken off the wire by code
that is neither memgate's nor aiohttp's. Used by test_agent_clis.py and probe.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.mock_model import (
    AGENTS_MD_MARK,
    CLAUDE_MD_MARK,
    README_MARK,
    SRC_MARK,
    MockModel,
)

ROOT = Path(__file__).resolve().parents[2]
# the shipped config (and its companion files); MEMGATE_E2E_RULES=<dir> names another
# rules/ (e.g. of a `git archive HEAD` tree run with PYTHONPATH=<tree>)
SHIPPED_CONFIG = Path(os.environ.get("MEMGATE_E2E_RULES", ROOT / "rules")) / "gateway.yaml"

# the two agent CLIs, pinned: name -> (npm package, version, command)
CLIENTS: dict[str, tuple[str, str, str]] = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
}
CLIENT_TIMEOUT_S = float(os.environ.get("MEMGATE_E2E_CLIENT_TIMEOUT_S", "180"))
INSTALL_TIMEOUT_S = 900.0

# what the user types; the mock plays the agent (TASK1 / TASK2 in tests/e2e/mock_model.py)
TASK1 = "TASK1: look around this project, read README.md and src/app.py, write out/task1.txt"
TASK2 = "TASK2: append a line to out/task1.txt and write out/task2.txt"
TASK1_DONE = "TASK1-DONE: readme=README-MARK-7731 src=SRC-MARK-4410 wrote_out_task1=yes"
TASK2_DONE = "TASK2-DONE: appended=yes"  # then task1_answer_in_history=yes|no

# fake keys: not placeholders memgate treats as "no key" (so it keeps session state)
CLAUDE_KEY = "sk-ant-api03-memgate-e2e-0000000000000000000000000000"
CODEX_KEY = "sk-proj-memgate-e2e-0000000000000000000000000000"
CLAUDE_MODEL = "claude-sonnet-4-5"
CODEX_MODEL = "gpt-5.2-codex"

# Claude Code: no telemetry, no error reports, no update checks, no non-essential traffic
# (feature flags, marketplace, surveys, release notes, ...)
CLAUDE_OFFLINE_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_UPDATES": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_GROWTHBOOK": "1",
    "DISABLE_BUG_COMMAND": "1",
    "DISABLE_INSTALLATION_CHECKS": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
    "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
    "CLAUDE_CODE_MAX_RETRIES": "0",
}

# Codex: its config.toml ($CODEX_HOME). Without `features.plugins = false` it runs
# `git ls-remote https://github.com/openai/plugins.git`, then asks api.github.com and
# chatgpt.com (curated plugin sync); `unbounded_connection_retries = false` makes a refused
# connection fail the run instead of "Reconnecting... waiting for network" for ever.
CODEX_CONFIG = """\
model = "{model}"
model_provider = "memgate"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
unbounded_connection_retries = false

[model_providers.memgate]
name = "memgate e2e"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "MEMGATE_E2E_OPENAI_KEY"
request_max_retries = 0
stream_max_retries = 0
supports_websockets = false
"""


# ---------------------------------------------------------------------------- install


def clients_dir() -> Path:
    return Path(os.environ.get("MEMGATE_E2E_CLIENTS_DIR",
                               Path.home() / ".cache" / "memgate-e2e")).expanduser()


def missing_tools() -> str | None:
    """Why the suite cannot run here (node or npm missing), else None."""
    gone = [t for t in ("node", "npm") if shutil.which(t) is None]
    return f"{' and '.join(gone)} not on PATH: the agent CLIs are npm packages" if gone else None


def client_prefix(name: str) -> Path:
    pkg, version, _ = CLIENTS[name]
    return clients_dir() / f"{pkg.lstrip('@').replace('/', '-')}-{version}"


def installed_version(name: str) -> str | None:
    pkg, _, _ = CLIENTS[name]
    meta = client_prefix(name) / "node_modules" / pkg / "package.json"
    try:
        version: str = json.loads(meta.read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError):
        return None
    return version


def install_client(name: str) -> Path:
    """The client's command, installed with npm into its fixture directory unless that
    directory already holds the pinned version. A failed install raises."""
    pkg, version, command = CLIENTS[name]
    prefix = client_prefix(name)
    binary = prefix / "node_modules" / ".bin" / command
    if installed_version(name) != version or not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        cmd = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
               f"{pkg}@{version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              check=False)
        if done.returncode != 0 or installed_version(name) != version or not binary.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with tempfile.TemporaryDirectory(prefix="memgate-e2e-home-") as home:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=60, check=False,
                             env={**base_env(Path(home)), "CODEX_HOME": home})
    if version not in out.stdout:
        raise RuntimeError(f"{binary} --version said {out.stdout!r} {out.stderr[-500:]!r}, "
                           f"wanted {version}")
    return binary


# ---------------------------------------------------------------------------- project


def write_project(root: Path) -> Path:
    """A small project with a recognisable line in each file."""
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(f"# e2e demo project\n\n{README_MARK}\n", encoding="utf-8")
    (root / "src" / "app.py").write_text(f'print("{SRC_MARK}")\n', encoding="utf-8")
    (root / "CLAUDE.md").write_text(f"{CLAUDE_MD_MARK}: keep answers short.\n",
                                    encoding="utf-8")
    (root / "AGENTS.md").write_text(f"{AGENTS_MD_MARK}: keep answers short.\n",
                                    encoding="utf-8")
    return root


# ---------------------------------------------------------------------------- TCP tap


@dataclass
class WireRequest:
    """One HTTP/1.1 request as a tap saw it go by."""

    conn: int
    t: float
    method: str
    target: str  # path and query, as on the request line
    headers: list[tuple[str, str]]
    body: bytes  # after chunked transfer decoding (framing is not content)
    raw_len: int  # bytes on the wire, head and framing included

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)

    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None


def parse_requests(data: bytes, conn: int = 0, times: list[tuple[int, float]] | None = None
                   ) -> list[WireRequest]:
    """The HTTP/1.1 requests in one connection's client-to-server bytes (a request cut
    short at the end is left out)."""
    out: list[WireRequest] = []
    pos = 0
    while pos < len(data):
        start = pos
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        lines = data[pos:end].decode("latin-1").split("\r\n")
        method, target, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
        headers = [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:])]
        hmap = {k.lower(): v for k, v in headers}
        pos = end + 4
        if "chunked" in hmap.get("transfer-encoding", "").lower():
            body = bytearray()
            while True:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    return out
                size = int(data[pos:eol].split(b";")[0], 16)
                pos = eol + 2
                if size == 0:
                    trailer_end = data.find(b"\r\n\r\n", pos - 2)
                    pos = (trailer_end + 4) if trailer_end >= 0 else len(data)
                    break
                body += data[pos:pos + size]
                pos += size + 2
            payload = bytes(body)
        else:
            n = int(hmap.get("content-length", "0") or 0)
            if pos + n > len(data):
                break
            payload, pos = data[pos:pos + n], pos + n
        t = 0.0
        for offset, when in times or []:
            if offset <= start:
                t = when
        out.append(WireRequest(conn, t, method, target, headers, payload, pos - start))
    return out


class Tap:
    """A TCP relay on 127.0.0.1 that keeps every byte its clients send (per connection,
    with arrival times) and passes everything on unchanged, both ways."""

    def __init__(self, name: str, target_port: int) -> None:
        self.name = name
        self.target_port = target_port
        self.streams: list[bytearray] = []
        self.times: list[list[tuple[int, float]]] = []
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._relay(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf, times = bytearray(), []
        self.streams.append(buf)
        self.times.append(times)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       keep: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if keep:
                        times.append((len(buf), time.time()))
                        buf.extend(data)
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except (ConnectionError, OSError):
                pass

        try:
            await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False))
        finally:
            for w in (writer, up_w):
                w.close()
                with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                    await w.wait_closed()

    def requests(self) -> list[WireRequest]:
        out = [r for i, (s, t) in enumerate(zip(self.streams, self.times))
               for r in parse_requests(bytes(s), i, t)]
        return sorted(out, key=lambda r: r.t)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# ---------------------------------------------------------------------------- memgate


def mem_fields(line: str) -> dict[str, str]:
    """A console [mem] line as key -> value (quoted values unquoted)."""
    out: dict[str, str] = {}
    for m in re.finditer(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', line[len("[mem] "):]):
        v = m.group(2)
        out[m.group(1)] = json.loads(v) if v.startswith('"') else v
    return out


class Memgate:
    """`memgate serve` as a process of its own, on a free port, its log kept."""

    def __init__(self, config: Path, upstream: str, cwd: Path) -> None:
        self.config = config
        self.upstream = upstream
        self.cwd = cwd
        self.lines: list[str] = []
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 60.0) -> None:
        exe = Path(sys.executable).with_name("memgate")
        cmd = [str(exe) if exe.exists() else "memgate", "serve", "--config", str(self.config),
               "--port", "0", "--drain-s", "2", "--upstream", self.upstream,
               "--anthropic-upstream", self.upstream]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGATE_")}
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=self.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        listening = asyncio.get_running_loop().create_future()
        self._reader = asyncio.get_running_loop().create_task(self._read(listening))
        try:
            self.port = await asyncio.wait_for(listening, timeout_s)
        except BaseException as err:
            await self.stop()
            raise RuntimeError("memgate did not start:\n"
                               + "\n".join(self.lines[-30:])) from err

    async def _read(self, listening: asyncio.Future[int]) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            m = re.search(r" listening host=\S+ port=(\d+)", line)
            if m and not listening.done():
                listening.set_result(int(m.group(1)))
        if not listening.done():
            listening.set_exception(RuntimeError("memgate exited"))

    def mem_lines(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("[mem] ")]

    def mem_events(self) -> list[dict[str, str]]:
        return [mem_fields(ln) for ln in self.mem_lines()]

    async def stop(self) -> int | None:
        """SIGTERM by pid, then SIGKILL if it is still there after 15 s."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            await self._reader
        return self.proc.returncode


def memgate_config(dest: Path, eviction: bool, max_tokens: int | None = None,
                   retrieve: bool | None = None) -> Path:
    """The shipped rules/gateway.yaml (and its companion files), with
    `memory.enable_eviction` set as asked, and `memory.budget.max_tokens` and
    `memory.retrieve.enabled` when given; nothing else changed."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in SHIPPED_CONFIG.parent.glob("*.yaml"):
        shutil.copy(f, dest / f.name)
    text = SHIPPED_CONFIG.read_text(encoding="utf-8")
    new, n = re.subn(r"(?m)^(  enable_eviction: )false\b", rf"\g<1>{str(eviction).lower()}",
                     text)
    assert n == 1, "rules/gateway.yaml: `  enable_eviction: false` not found"
    if max_tokens is not None:
        new, n = re.subn(r"(?m)^(    max_tokens: )\d+", rf"\g<1>{max_tokens}", new)
        assert n == 1, "rules/gateway.yaml: `    max_tokens: N` not found"
    if retrieve is not None:
        new, n = re.subn(r"(?m)^(  retrieve:.*\n    enabled: )(?:true|false)\b",
                         rf"\g<1>{str(retrieve).lower()}", new)
        assert n == 1, "rules/gateway.yaml: `  retrieve:` + `    enabled: ...` not found"
    (dest / "gateway.yaml").write_text(new, encoding="utf-8")
    return dest / "gateway.yaml"


# ---------------------------------------------------------------------------- clients


@dataclass
class Run:
    """One client invocation."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    trace: Path | None  # strace output (connect/sendto/sendmsg of the whole process tree)

    def foreign_addresses(self) -> list[str]:
        """What the process tree tried to reach beyond loopback: addresses other than
        127.0.0.1 / ::1, and every DNS query (port 53, loopback resolvers included), with
        the name asked for where strace shows it."""
        if self.trace is None or not self.trace.exists():
            return []
        return sorted(foreign_in_trace(self.trace.read_text(encoding="utf-8",
                                                            errors="replace")))


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
_SOCKADDR = re.compile(r'sin6?_port=htons\((\d+)\).*?(?:inet_addr\("([^"]+)"\)'
                       r'|inet_pton\(AF_INET6, "([^"]+)")')
_DNS_NAME = re.compile(r'\\0\\0\\0\\0\\0\\0((?:\\\d{1,3}[A-Za-z0-9-]+)+)\\0')


def foreign_in_trace(text: str) -> set[str]:
    """From strace lines (connect, sendto, sendmsg, sendmmsg): non-loopback destinations,
    and `dns@<resolver> <name>` for each query to port 53."""
    out: set[str] = set()
    for line in text.splitlines():
        for port, v4, v6 in _SOCKADDR.findall(line):
            addr = v4 or v6
            if port == "53":
                names = [".".join(re.split(r"\\\d{1,3}", n)[1:])
                         for n in _DNS_NAME.findall(line)]
                out.add(f"dns@{addr} {','.join(names)}".strip())
            elif addr not in LOOPBACK:
                out.add(addr)
    return out


def strace_usable() -> bool:
    if os.environ.get("MEMGATE_E2E_STRACE", "1") == "0" or shutil.which("strace") is None:
        return False
    ok = subprocess.run(["strace", "-f", "-qq", "-e", "trace=none", "true"],
                        capture_output=True, timeout=30, check=False)
    return ok.returncode == 0


async def run_client(argv: list[str], env: dict[str, str], cwd: Path, trace: Path | None,
                     timeout_s: float = CLIENT_TIMEOUT_S) -> Run:
    """Run a client to its end (or kill its process group after timeout_s)."""
    cmd = list(argv)
    if trace is not None:
        cmd = ["strace", "-f", "-qq", "-s", "64", "-o", str(trace),
               "-e", "trace=connect,sendto,sendmsg,sendmmsg"] + cmd
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)
    timed_out = False
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the client and children
        out, err = await proc.communicate()
    return Run(argv, proc.returncode, out.decode("utf-8", "replace"),
               err.decode("utf-8", "replace"), time.perf_counter() - t0, timed_out, trace)


def base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({"HOME": str(home), "TERM": "dumb", "NO_COLOR": "1", "CI": "1",
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    return env


def claude_commands(binary: Path, base_url: str, home: Path) -> tuple[list[list[str]],
                                                                      dict[str, str]]:
    env = {**base_env(home), **CLAUDE_OFFLINE_ENV,
           "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": CLAUDE_KEY}
    # root may not use --dangerously-skip-permissions; --allowedTools lets -p run these
    common = ["--model", CLAUDE_MODEL, "--allowedTools", "Bash,Read,Write,Edit"]
    return [[str(binary), "-p", TASK1, *common],
            [str(binary), "-p", "--continue", TASK2, *common]], env


def codex_commands(binary: Path, base_url: str, home: Path) -> tuple[list[list[str]],
                                                                     dict[str, str]]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        CODEX_CONFIG.format(model=CODEX_MODEL, base_url=base_url), encoding="utf-8")
    env = {**base_env(home), "CODEX_HOME": str(codex_home), "MEMGATE_E2E_OPENAI_KEY": CODEX_KEY}
    flags = ["--strict-config", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox"]
    return [[str(binary), "exec", *flags, TASK1],
            [str(binary), "exec", "resume", "--last", *flags, TASK2]], env


# ---------------------------------------------------------------------------- a session


@dataclass
class Session:
    """Everything one client's two-task session through memgate left behind."""

    client: str
    eviction: bool
    project: Path
    runs: list[Run] = field(default_factory=list)
    sent: list[WireRequest] = field(default_factory=list)  # client -> memgate
    forwarded: list[WireRequest] = field(default_factory=list)  # memgate -> mock
    model: MockModel | None = None
    mem_lines: list[str] = field(default_factory=list)
    memgate_log: list[str] = field(default_factory=list)
    memgate_exit: int | None = None


async def run_session(client: str, binary: Path, workdir: Path, eviction: bool,
                      trace: bool | None = None, max_tokens: int | None = None,
                      retrieve: bool | None = None) -> Session:
    """The client's two tasks (TASK1, then TASK2 continuing the same session) through a
    fresh memgate and mock model (memgate_config's settings); every process started here
    is stopped here."""
    if trace is None:
        trace = strace_usable()
    project = write_project(workdir / "project")
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    session = Session(client, eviction, project)
    model = MockModel(cwd=str(project))
    session.model = model
    await model.start()
    up_tap = Tap("upstream", int(model.url.rsplit(":", 1)[1]))
    await up_tap.start()
    gate = Memgate(memgate_config(workdir / "rules", eviction, max_tokens, retrieve),
                   up_tap.url, workdir)
    client_tap: Tap | None = None
    try:
        await gate.start()
        client_tap = Tap("client", gate.port)
        await client_tap.start()
        make = claude_commands if client == "claude" else codex_commands
        commands, env = make(binary, client_tap.url, home)
        for i, argv in enumerate(commands, start=1):
            path = workdir / f"{client}-task{i}.strace" if trace else None
            run = await run_client(argv, env, project, path)
            session.runs.append(run)
            if run.returncode != 0:
                break
        # the [mem] line follows the response: wait for one per chat request sent
        want = sum(1 for r in client_tap.requests() if r.method == "POST"
                   and r.target.split("?", 1)[0] in ("/v1/messages", "/v1/responses"))
        for _ in range(100):
            if len(gate.mem_lines()) >= want:
                break
            await asyncio.sleep(0.05)
    finally:
        if client_tap is not None:
            await client_tap.stop()
        session.memgate_exit = await gate.stop()
        await up_tap.stop()
        await model.stop()
    session.sent = client_tap.requests() if client_tap is not None else []
    session.forwarded = up_tap.requests()
    session.mem_lines = gate.mem_lines()
    session.memgate_log = gate.lines
    return session


# ---------------------------------------------------------------------------- a crowd


@dataclass
class Launch:
    """One client session of a crowd: which client, where it runs, what the user types."""

    client: str
    binary: Path
    project: str  # the project directory's name under the crowd's workdir
    prompt: str


@dataclass
class Crowd:
    """Several client sessions run at once through ONE memgate and one mock model. Each
    session's `sent` comes from its own client-side tap; `forwarded`, `model` and the
    memgate log are the crowd's, shared."""

    sessions: list[Session]
    forwarded: list[WireRequest]
    model: MockModel
    mem_lines: list[str]
    memgate_log: list[str]
    memgate_exit: int | None


async def run_crowd(launches: list[Launch], workdir: Path, eviction: bool) -> Crowd:
    """Start one mock model, one memgate and the taps once, then run each launch's first
    task at the same time (asyncio.gather). Launches naming the same project share its
    directory; each session has a home of its own (its client's session store) and a
    client-side tap of its own. The mock has no fixed cwd: Claude Code reads through
    `cat` in its shell and Codex runs in its own directory. Every process started here is
    stopped here."""
    model = MockModel(cwd=None)
    await model.start()
    up_tap = Tap("upstream", int(model.url.rsplit(":", 1)[1]))
    await up_tap.start()
    gate = Memgate(memgate_config(workdir / "rules", eviction), up_tap.url, workdir)
    taps: list[Tap] = []
    sessions: list[Session] = []
    try:
        await gate.start()
        jobs = []
        for n, launch in enumerate(launches):
            project = workdir / launch.project
            if not (project / "README.md").exists():
                write_project(project)
            home = workdir / f"home-{n}"
            home.mkdir(parents=True, exist_ok=True)
            tap = Tap(f"client-{n}", gate.port)
            await tap.start()
            taps.append(tap)
            sessions.append(Session(launch.client, eviction, project, model=model))
            make = claude_commands if launch.client == "claude" else codex_commands
            commands, env = make(launch.binary, tap.url, home)
            argv = [launch.prompt if a == TASK1 else a for a in commands[0]]
            jobs.append(run_client(argv, env, project, None))
        for session, run in zip(sessions, await asyncio.gather(*jobs)):
            session.runs.append(run)
        want = sum(1 for t in taps for r in t.requests() if r.method == "POST"
                   and r.target.split("?", 1)[0] in ("/v1/messages", "/v1/responses"))
        for _ in range(100):
            if len(gate.mem_lines()) >= want:
                break
            await asyncio.sleep(0.05)
    finally:
        for tap in taps:
            await tap.stop()
        exit_code = await gate.stop()
        await up_tap.stop()
        await model.stop()
    for session, tap in zip(sessions, taps):
        session.sent = tap.requests()
        session.mem_lines = gate.mem_lines()
        session.memgate_log = gate.lines
        session.memgate_exit = exit_code
    return Crowd(sessions, up_tap.requests(), model, gate.mem_lines(), gate.lines, exit_code)
