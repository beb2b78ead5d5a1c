"""The integrations group (``tests/integrations``) stays out of the default run without being imported, and
any ``-m`` expression that selects it collects it.

The default run must not import a framework: ``make test`` runs it before the extras are installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
GROUP = HERE / "integrations"


def _conftest():
    spec = importlib.util.spec_from_file_location("integrations_conftest", GROUP / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_run_collects_nothing_of_the_group_and_imports_no_framework() -> None:
    code = ("import sys, pytest\n"
            f"rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', {str(GROUP)!r}])\n"
            "print('RESULT', rc, *(name in sys.modules for name in ('lightning', 'transformers', 'accelerate')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT")).split()
    assert result == ["RESULT", "5", "False", "False", "False"], done.stdout[-2000:]  # 5: no tests collected


@pytest.mark.parametrize(("markexpr", "collected"), [
    ("not slow and not bench and not gpu and not integrations", False),
    ("not integrations", False),
    ("integrations", True),
    ("integrations or not integrations", True),
    ("not integrations or integrations", True),
    ("not slow", True),
    ("", True),
])
def test_an_expression_that_selects_the_group_collects_its_modules(markexpr: str, collected: bool) -> None:
    config = SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))
    ignored = _conftest().pytest_ignore_collect(GROUP / "test_lightning_io.py", config)
    assert (ignored is None) is collected
    assert _conftest().pytest_ignore_collect(GROUP / "data", config) is None, "only the group's modules"
