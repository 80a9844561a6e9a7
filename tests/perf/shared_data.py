"""Where the eval scripts find the shared data sets, and one line when they are not there.

The data sets are not part of the repository: they live in `shared/data` beside the
checkout (`../shared/data`, the README's layout), or wherever $MEMGATE_DATA or the
script's own flag points. A missing file ends the script with what it looked for
and how to point it elsewhere (exit 2), not with a traceback from deep inside.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """$MEMGATE_DATA, else ../shared/data beside the checkout (also from a git worktree
    one level further down)."""
    if os.environ.get("MEMGATE_DATA"):
        return Path(os.environ["MEMGATE_DATA"])
    for base in (ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    return ROOT.parent / "shared" / "data"


def require(flag: str, *paths: Path) -> None:
    """Exit 2 with one line naming the first of `paths` that does not exist."""
    for path in paths:
        if not path.exists():
            script = Path(sys.argv[0]).name
            print(f"{script}: {path}: not found (the shared data sets; point {flag} at "
                  "them, or set MEMGATE_DATA)", file=sys.stderr)
            raise SystemExit(2)
