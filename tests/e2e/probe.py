"""Run Claude Code and Codex through memgate (eviction on or off) against the mock model
and print, per request, what the client sent against what memgate forwarded.

    /tmp/venv/bin/python -m tests.e2e.probe --eviction on      # from the repository root
    /tmp/venv/bin/python -m tests.e2e.probe --eviction off --client codex --mem

memgate runs as `memgate serve` (the venv's), with the environment's PYTHONPATH: to probe
another tree (say HEAD while the working tree is mid-edit), point both at it:
    git archive HEAD gateway rules | tar -x -C /tmp/memgate-head
    PYTHONPATH=/tmp/memgate-head MEMGATE_E2E_RULES=/tmp/memgate-head/rules \
        /tmp/venv/bin/python -m tests.e2e.probe --eviction on

Columns: msgs = messages (Responses: input items) sent > forwarded; tok sent / tok fwd =
memgate's estimate (`est_tokens`, `est_sent_tokens`); T1 text / T1 ans = the forwarded body
still holds the first task's request text / its final answer (- before the client sent
it); context = the opening message's client context still forwarded (Claude Code's
<system-reminder> blocks, Codex's AGENTS.md and <environment_context> items), of how many;
instr = the project's CLAUDE.md (Claude Code) / AGENTS.md (Codex) line still forwarded;
dropped (+note: a carry note was injected); memgate session = the `session=` it logged.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # python tests/e2e/probe.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.harness import CLIENTS, install_client, missing_tools, run_session  # noqa: E402
from tests.e2e.report import byte_differences, format_report  # noqa: E402


async def probe(clients: list[str], eviction: bool, keep: bool, show_mem: bool) -> int:
    status = 0
    for name in clients:
        t0 = time.perf_counter()
        binary = install_client(name)
        print(f"# {name} {CLIENTS[name][1]}: {binary} ({time.perf_counter() - t0:.1f}s)")
        workdir = Path(tempfile.mkdtemp(prefix=f"memgate-probe-{name}-"))
        try:
            t0 = time.perf_counter()
            try:
                s = await run_session(name, binary, workdir, eviction)
            except RuntimeError as err:  # memgate did not start: its log says why
                print(f"   {err}")
                status = 1
                continue
            print(format_report(s))
            diffs = byte_differences(s)
            print(f"   requests changed on the way (body or headers): "
                  f"{len({d.split(':')[0] for d in diffs})} of {len(s.sent)}"
                  f"  [session {time.perf_counter() - t0:.1f}s]")
            if show_mem:
                print("\n".join(s.mem_lines))
            if any(r.returncode != 0 for r in s.runs) or len(s.runs) < 2:
                status = 1
                for r in s.runs:
                    print(f"   exit={r.returncode} timed_out={r.timed_out}\n"
                          f"   stdout: {r.stdout[-1500:]}\n   stderr: {r.stderr[-1500:]}")
        finally:
            if keep:
                print(f"   kept: {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        print()
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eviction", choices=("on", "off"), default="on",
                    help="memory.enable_eviction in the shipped config (default on)")
    ap.add_argument("--client", choices=("claude", "codex", "both"), default="both")
    ap.add_argument("--mem", action="store_true", help="also print memgate's [mem] lines")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    args = ap.parse_args(argv)
    reason = missing_tools()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    clients = list(CLIENTS) if args.client == "both" else [args.client]
    return asyncio.run(probe(clients, args.eviction == "on", args.keep, args.mem))


if __name__ == "__main__":
    sys.exit(main())
