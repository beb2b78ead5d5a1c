"""A plain restore (same world size, no resharding) never imports ``torch.distributed.checkpoint``: that import
is about 1.5 s of a replacement rank's start under load, the biggest part of its recovery with no spare.

Each check runs in a fresh interpreter (a subprocess), where ``sys.modules`` tells what was imported.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_PROGRAM = textwrap.dedent("""
    import sys

    import torch

    import ckptd
    import ckptd.elastic
    from ckptd.elastic.worker import run  # what a rank of ``ckptd launch`` imports

    manager = ckptd.CheckpointManager(sys.argv[1])
    saved = {"weights": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step_count": 7}
    manager.save(2, saved, force=True)
    manager.wait()
    manager.close()

    again = ckptd.CheckpointManager(sys.argv[1])  # a new process's manager: it reads the local tier
    live = {"weights": torch.zeros(3, 4), "step_count": 0}
    restored = again.restore(live)
    again.close()
    assert restored == 2, restored
    assert torch.equal(live["weights"], saved["weights"]) and live["step_count"] == 7, live
    print(sorted(name for name in sys.modules if name.startswith("torch.distributed.checkpoint")))
""")


def test_importing_ckptd_elastic_and_a_plain_restore_leave_dcp_unimported(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _PROGRAM, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", f"a plain restore imported DCP: {done.stdout[-2000:]}"


def test_the_resharding_module_still_reaches_dcp_when_asked() -> None:
    # the lazy import works: the names the restore path imports on a resharded step exist and import DCP
    program = ("import sys; from ckptd.dcp.resharding import resharded_source, live_reader; "
               "from ckptd.dcp.reader import CkptdStorageReader; "
               "print('torch.distributed.checkpoint' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "True"
