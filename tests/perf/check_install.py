"""A real non-editable install, used from a folder that is not the checkout.

    python tests/perf/check_install.py [--keep]

Creates a fresh venv, `pip install <checkout>` (a wheel, not -e), then from an empty
temporary directory: `memgate --version`, `memgate demo` (must find the shipped
samples), `memgate check-config` on the shipped config, and `memgate serve --port 0`
until its startup lines name the installed model map and carry patterns. ~30 s with
the dependencies in pip's cache, so it is a script, not a test. Exit 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""))
    return ok


def serve_startup(memgate: Path, cwd: Path) -> str:
    """The serve process's stderr up to its `listening` line (then SIGTERM)."""
    proc = subprocess.Popen([str(memgate), "serve", "--port", "0"], cwd=cwd,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if " listening " in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return "".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the temporary venv and folder")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="memgate-install-"))
    venv, away = tmp / "venv", tmp / "elsewhere"
    away.mkdir()
    t0 = time.monotonic()
    made = run([sys.executable, "-m", "venv", str(venv)], tmp)
    pip = run([str(venv / "bin" / "pip"), "install", "-q", str(ROOT)], tmp, timeout=900)
    if not check("pip install . (non-editable)", made.returncode == 0 and pip.returncode == 0,
                 (made.stderr + pip.stderr)[-2000:]):
        return 1
    print(f"     installed in {time.monotonic() - t0:.1f} s")
    memgate = venv / "bin" / "memgate"
    site = next((venv / "lib").glob("python3*/site-packages"))
    results = []
    version = run([str(memgate), "--version"], away)
    results.append(check("memgate --version", version.returncode == 0
                         and version.stdout.startswith("memgate "), version.stderr))
    demo = run([str(memgate), "demo"], away)
    results.append(check("memgate demo from another folder", demo.returncode == 0
                         and demo.stdout.count("[mem] ") >= 2
                         and str(site) in demo.stdout, demo.stderr[-2000:]))
    shipped = site / "gateway" / "_data" / "rules" / "gateway.yaml"
    cc = run([str(memgate), "check-config", str(shipped)], away)
    results.append(check("memgate check-config <shipped gateway.yaml>", cc.returncode == 0,
                         cc.stderr))
    startup = serve_startup(memgate, away)
    results.append(check("memgate serve names the installed model map and carry patterns",
                         f"models_file={site}" in startup and f"carry_file={site}" in startup
                         and "Traceback" not in startup, startup[-2000:]))
    if args.keep:
        print(f"kept {tmp}")
    else:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return 0 if all(results) else 1


if __name__ == "__main__":
    os.environ.pop("PYTHONPATH", None)  # the installed package, not the checkout
    raise SystemExit(main())
