"""The agent-CLI suite's fixtures: the pinned clients, installed once with npm into a
directory reused across runs (~/.cache/memgate-e2e, or $MEMGATE_E2E_CLIENTS_DIR).

The suite is slow and needs npm's registry the first time, so a plain `pytest` (the whole
tree, as .ci/run does) skips it; it runs when asked for: `-m slow`, a path inside
tests/e2e, or MEMGATE_E2E=1.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.e2e.harness import CLIENTS, install_client, missing_tools

HERE = Path(__file__).resolve().parent


def _asked_for(config: pytest.Config) -> bool:
    if os.environ.get("MEMGATE_E2E") == "1":
        return True
    expr = config.getoption("markexpr", "") or ""
    if "slow" in expr and "not slow" not in expr:
        return True
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _asked_for(config):
        return
    skip = pytest.mark.skip(reason="agent-CLI e2e suite (slow, installs npm packages): "
                                   "run it with -m slow, pytest tests/e2e or MEMGATE_E2E=1")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def agent_clients() -> dict[str, Path]:
    """name -> the client's command. Skips only when node or npm is missing; an install
    that fails is an error."""
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    out = {}
    for name in CLIENTS:
        t0 = time.perf_counter()
        out[name] = install_client(name)
        print(f"{name}: {out[name]} ready in {time.perf_counter() - t0:.1f}s")
    return out
