"""The built distribution holds every package: each directory under ``ckptd/`` with an ``__init__.py``
is listed in ``pyproject.toml`` (an editable install finds unlisted ones, a wheel silently drops them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_distribution() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "ckptd").rglob("__init__.py")}
    assert found, "packages were found"
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
