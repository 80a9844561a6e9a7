"""Build hook: the wheel carries the top-level rules/ and samples/ as gateway/_data/.

The directories stay where the design card puts them (top level, read in place by a
checkout or an editable install); a non-editable install has no checkout, so the
build copies them into the package (gateway/config/resources.py looks there first).
Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("rules", "samples")


class BuildWithData(build_py):  # type: ignore[misc]
    def run(self) -> None:
        super().run()
        for name in SHIPPED:
            src = ROOT / name
            dst = Path(self.build_lib) / "gateway" / "_data" / name
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithData})
