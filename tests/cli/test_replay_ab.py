"""memgate replay ab against a deterministic upstream that answers from its input."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.mock_upstream import create_mock_app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


async def run_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "replay", "ab", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode()


@pytest.fixture
async def evidence_upstream(aiohttp_server: Any) -> str:
    server = await aiohttp_server(create_mock_app())
    return str(server.make_url("")).rstrip("/")


async def test_pinned_probes_pass_and_report_is_written(
    evidence_upstream: str, tmp_path: Path
) -> None:
    """Early constraint and mid conclusion are pinned: B restates them like A; reports exist."""
    code, out = await run_cli("samples/chat_long_tools.json", "--probes",
                              "samples/probes_long_tools.yaml", "--upstream", evidence_upstream,
                              "--repeat", "2", "--out", str(tmp_path),
                              "--config", "rules/gateway.yaml")
    assert "PASS early-constraint" in out and "PASS mid-conclusion" in out, out
    md = (tmp_path / "report.md").read_text()
    assert "report_0421.csv" in md and "| pinned_in_b | ok |" in md
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")
    assert code == (0 if "FAIL" not in out else 1)


async def test_a_lost_fact_fails_for_real(evidence_upstream: str, tmp_path: Path) -> None:
    """A probe about an early, unpinned detail: A restates it, B (eviction without the
    fill, which would bring the turn the question names back) cannot; exit 1."""
    shipped = (ROOT / "rules" / "gateway.yaml").read_text()
    config = tmp_path / "gateway.yaml"
    config.write_text(shipped.replace("recall_share: 0.4", "recall_share: 0.0"))
    code, out = await run_cli("samples/chat_long_tools.json", "--probes",
                              "samples/probes_lost_fact.yaml", "--upstream", evidence_upstream,
                              "--out", str(tmp_path), "--config", str(config))
    assert code == 1, out
    assert "FAIL dropped-detail" in out
    assert "FAIL b_restates:Turn 1: list /data/refunds" in out
    md = (tmp_path / "report.md").read_text()
    assert "| a_restates:Turn 1: list /data/refunds | ok |" in md


async def test_as_configured_confirms_a_rollback(evidence_upstream: str, tmp_path: Path) -> None:
    """With the kill switch off and --as-configured, B is A: the lost-fact probe passes."""
    code, out = await run_cli("samples/chat_long_tools.json", "--probes",
                              "samples/probes_lost_fact.yaml", "--upstream", evidence_upstream,
                              "--out", str(tmp_path), "--config", "rules/gateway.yaml",
                              "--as-configured")
    assert code == 0, out
    assert "PASS dropped-detail" in out
