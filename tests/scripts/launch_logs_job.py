"""A 2-rank job that prints to stdout and stderr, for the tests of torchrun's logging options.

``ckptd launch ... launch_logs_job.py plain OUT``: no ckptd import (whole-group restarts); in attempt 0 rank 1
SIGKILLs itself once rank 0 printed, and rank 0 waits to be ended by the group restart.
``ckptd launch ... launch_logs_job.py raise OUT``: no ckptd import; every rank forms a gloo group through
``env://``, then rank 1 raises an uncaught RuntimeError (torch's excepthook prefixes its lines with ``[rank1]:``).
Every line names the rank, the attempt or generation and the process id.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time


def _wait_for(pattern: str) -> None:
    deadline = time.monotonic() + 120
    while not glob.glob(pattern):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {pattern}")
        time.sleep(0.02)


def plain(out: str) -> None:
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"out rank {rank} attempt {attempt} pid {os.getpid()}", flush=True)
    print(f"err rank {rank} attempt {attempt} pid {os.getpid()}", file=sys.stderr, flush=True)
    if attempt != "0":
        return
    if rank == "1":
        _wait_for(os.path.join(out, "printed0"))
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(out, "printed0"), "w").close()
    _wait_for(os.path.join(out, "never"))  # ended by the group restart


def uncaught(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank 1")
    dist.barrier()  # fails once rank 1 is gone


if __name__ == "__main__":
    if sys.argv[1] == "raise":
        uncaught(sys.argv[2])
    else:
        plain(sys.argv[2])
