"""Where the shipped `rules/` and `samples/` are: a checkout or an installed package.

In a checkout (and an editable install) they are the top-level directories beside
`gateway/`. A wheel (`pip install .`) has no such directories: the build copies them
into the package as `gateway/_data/rules` and `gateway/_data/samples` (setup.py), so
an installed `memgate` finds its model map, carry patterns and demo samples wherever
it is run from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # gateway/, this file being gateway/config/
CHECKOUT_ROOT = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "_data"
SHIPPED = ("rules", "samples")


def shipped_dir(name: str) -> Path | None:
    """The shipped directory `name` (rules | samples), installed copy first."""
    if name not in SHIPPED:
        raise ValueError(f"not a shipped directory: {name!r}")
    for candidate in (DATA_DIR / name, CHECKOUT_ROOT / name):
        if candidate.is_dir():
            return candidate
    return None


def shipped_file(directory: str, name: str) -> Path | None:
    """A file of a shipped directory, e.g. ("rules", "models.yaml"); None if absent."""
    base = shipped_dir(directory)
    path = base / name if base is not None else None
    return path if path is not None and path.is_file() else None


def default_config(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """--config > MEMGATE_CONFIG > ./rules/gateway.yaml > the rules/gateway.yaml shipped
    with memgate (a checkout's, or the installed package's copy)."""
    if explicit:
        return Path(explicit)
    if env.get("MEMGATE_CONFIG"):
        return Path(env["MEMGATE_CONFIG"])
    local = Path("rules/gateway.yaml")
    return local if local.is_file() else shipped_file("rules", "gateway.yaml")
