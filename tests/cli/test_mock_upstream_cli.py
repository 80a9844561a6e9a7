"""`python -m gateway.cli.mock_upstream`: the demo's upstream on its own, so a newcomer can
point the real SDKs at `memgate serve` without a provider key (README, Point your client)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import ROOT, SECRET

pytestmark = pytest.mark.slow

ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}


@contextmanager
def spawned(args: list[str], pattern: str, cwd: Path) -> Iterator[tuple[int, list[str]]]:
    """A subprocess whose merged output announces a port (`pattern`, one group); yields
    that port and the lines read so far (read on until the process ends)."""
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"{args} exited before listening: {''.join(lines)}"
            lines.append(line)
            found = re.search(pattern, line)
            if found:
                break
        assert found, lines
        yield int(found[1]), lines
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=30)
        lines.append(rest)


def test_the_sdks_through_memgate_to_the_standalone_mock(tmp_path: Path) -> None:
    """The mock on a free port, memgate in front of it: the openai and anthropic SDKs get
    answers, and the [mem] lines carry the mock's usage."""
    with spawned(["-m", "gateway.cli.mock_upstream", "--port", "0"],
                 r"listening on http://127\.0\.0\.1:(\d+)", tmp_path) as (mock, _):
        up = f"http://127.0.0.1:{mock}"
        with spawned(["-m", "gateway", "serve", "--port", "0", "--upstream", up,
                      "--anthropic-upstream", up], r" listening .*port=(\d+)",
                     tmp_path) as (port, log):
            url = f"http://127.0.0.1:{port}"
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=SECRET, max_retries=0)
            chat = c.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hello mock"}])
            assert "hello mock" in (chat.choices[0].message.content or "")
            assert chat.usage is not None and chat.usage.prompt_tokens > 0
            a = anthropic.Anthropic(base_url=url, api_key=SECRET, max_retries=0)
            msg = a.messages.create(model="claude-3-5-haiku-20241022", max_tokens=20,
                                    messages=[{"role": "user", "content": "hi claude"}])
            assert msg.usage.input_tokens > 0
            time.sleep(0.5)  # the [mem] lines follow the answers
    text = "".join(log)
    mem = [ln for ln in text.splitlines() if ln.startswith("[mem] ")]
    assert len(mem) == 2 and all("usage_in=" in ln and "status=200" in ln for ln in mem)
    assert SECRET not in text and "Traceback" not in text


def test_a_bad_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "gateway.cli.mock_upstream", "--port", "99999"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 2 and "--port 99999" in res.stderr
    assert "Traceback" not in res.stderr


def test_the_eval_scripts_run_as_files_as_the_readme_writes_them(tmp_path: Path) -> None:
    """`python tests/perf/eval_locomo.py` (the README's spelling) from a checkout whose
    `tests` is not on the path: without the data sets, one line naming the missing file
    and exit 2, not `ModuleNotFoundError: No module named 'tests'`."""
    env = {"PATH": os.environ.get("PATH", "")}  # no PYTHONPATH: as a newcomer's shell
    missing = tmp_path / "nothing-here"
    runs = {script: subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "perf" / script), flag, str(missing)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for script, flag in (("eval_locomo.py", "--data"), ("eval_bfcl_compact.py",
                             "--payloads"), ("eval_cache_stability.py", "--bfcl"))}
    for script, proc in runs.items():  # side by side: each pays the imports
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (script, err)
        assert "Traceback" not in err and "not found" in err, err
