"""The fork server of ``ckptd launch`` (``--preload``, the default): a supervisor waits for its imports before
it joins the job, and that wait has a deadline and names what it waits for.

:mod:`multiprocessing` keeps one fork server per process, so each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_PROGRAM = textwrap.dedent("""
    import json, os, sys, time
    from ckptd.elastic.preloaded import PreloadedStarter
    from ckptd.errors import DeadlineError

    starter = PreloadedStarter(dict(os.environ), preload=["ckptd.elastic.fork_server_guard", "slow_import"])
    started = time.monotonic()
    try:
        starter.warm(timeout_s=float(sys.argv[1]))
    except DeadlineError as error:
        print(json.dumps({"error": str(error), "waited": time.monotonic() - started}))
        sys.exit(0)
    warmed = time.monotonic()
    rank = starter.start([sys.executable, "-u", sys.argv[2], sys.argv[3]], dict(os.environ))
    forked = time.monotonic()
    print(json.dumps({"waited": warmed - started, "start_s": forked - warmed, "code": rank.wait(30)}))
""")


def _warm(tmp_path: Path, module_text: str, timeout_s: float) -> dict:
    import json

    (tmp_path / "slow_import.py").write_text(module_text)
    (tmp_path / "rank.py").write_text("import sys\nopen(sys.argv[1], 'w').write(str('slow_import' in sys.modules))\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run([sys.executable, "-c", _PROGRAM, str(timeout_s), str(tmp_path / "rank.py"),
                             str(tmp_path / "rank.txt")], capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_warm_up_gives_up_at_its_deadline_naming_the_fork_server(tmp_path: Path) -> None:
    outcome = _warm(tmp_path, "import time\ntime.sleep(60)\n", timeout_s=1.0)
    assert "fork server to import torch and ckptd" in outcome.get("error", ""), outcome
    assert "--no-preload" in outcome["error"] and outcome["waited"] < 15, outcome


def test_the_warm_up_returns_once_the_imports_are_done_and_ranks_start_at_once(tmp_path: Path) -> None:
    marker, imports = tmp_path / "imported", tmp_path / "imports"
    outcome = _warm(tmp_path, f"import pathlib, time\nwith open({str(imports)!r}, 'a') as log:\n    log.write('x')\n"
                              f"time.sleep(1)\npathlib.Path({str(marker)!r}).write_text('x')\n", timeout_s=60)
    assert "error" not in outcome and outcome["code"] == 0, outcome
    assert marker.exists() and outcome["waited"] >= 1.0, "warm() returned before the fork server's imports were done"
    assert imports.read_text() == "x", f"the rank's start imported again what the warm-up had imported ({outcome})"
    assert (tmp_path / "rank.txt").read_text() == "True", "the rank was not forked from the preloaded server"
