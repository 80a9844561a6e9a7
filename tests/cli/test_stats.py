"""memgate stats on saved payloads and [mem] logs, with and without a policy."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gateway.cli import stats
from gateway.config.rules import load_rules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.wire import sniff

ROOT = Path(__file__).resolve().parents[2]
RULES = load_rules(ROOT / "rules" / "gateway.yaml", {})


def test_payload_measures_match_the_gateway() -> None:
    """Per payload: messages, chars and tokens are what the gateway's [mem] line says."""
    files = sorted((ROOT / "samples").glob("*.json"))
    report = stats.measure([str(f) for f in files], RULES, simulate=False)
    assert len(report.samples) == len(files) and report.skipped == []
    tok = Tokenizers(1000)
    for f, got in zip(files, report.samples, strict=True):
        body = orjson.loads(f.read_bytes())
        d = decide(f.read_bytes(), body, RULES, tok, sniff(body, f.name))
        assert (got.messages, got.chars, got.tokens) == (len(d.messages), d.hist_chars(),
                                                          d.est_tokens())


def test_mem_logs_and_long_tail() -> None:
    """JSON and console [mem] lines are read; the top 10% of sessions' share is reported."""
    lines = [json.dumps({"event": "mem", "session": f"s{i}", "hist_msgs": 2, "hist_chars": 10,
                         "est_tokens": 100}) for i in range(9)]
    lines.append("[mem] session=big turn=9 hist_msgs=90 hist_chars=900 est_tokens=9100 "
                 "budget_tokens=6000 evict=none kept=90 dropped=0 pinned=0")
    lines.append("not a record")  # text: another program's, not a skipped request
    lines.append('{"model": "gpt-4o", "messages": [')  # a payload line cut short: skipped
    report = stats.measure(["-"], RULES, simulate=False, stdin=io.StringIO("\n".join(lines)))
    s = stats.summary(report)
    assert s["requests"] == 10 and s["skipped"] == 1
    assert s["sources"] == {"payloads": 0, "mem_lines": 10, "other_log_lines": 1}
    assert s["tokens"]["max"] == 9100 and s["tokens"]["p50"] == 100
    assert s["sessions"]["top10pct_sessions"] == 1
    assert s["sessions"]["top10pct_share_of_tokens"] == round(9100 / 10000, 4)


@pytest.mark.slow
def test_policy_simulation_cli() -> None:
    """--config simulates the policy: evicted requests and dropped messages as evict says."""
    res = subprocess.run([sys.executable, "-m", "gateway", "stats", "samples", "--config",
                          "rules/gateway.yaml", "--json"], cwd=ROOT, capture_output=True,
                         text=True, check=False, timeout=120)
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    tok = Tokenizers(1000)
    on = load_rules(ROOT / "rules" / "gateway.yaml", {"MEMGATE_ENABLE_EVICTION": "1"})
    dropped = evicted = 0
    for f in sorted((ROOT / "samples").glob("*.json")):
        body = orjson.loads(f.read_bytes())
        p = decide(f.read_bytes(), body, on, tok, sniff(body, f.name)).plan
        dropped += len(p.dropped)
        evicted += bool(p.dropped)
    assert s["policy"]["messages_dropped"] == dropped and dropped > 0
    assert s["policy"]["evicted_requests"] == evicted
