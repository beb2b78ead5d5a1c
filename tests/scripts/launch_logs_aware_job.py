"""The ckptd-aware twin of ``launch_logs_job.py`` (kept apart so that the launcher reads that one as a script
without ckptd): ``ckptd launch ... launch_logs_aware_job.py aware OUT [spare]`` runs ``ckptd.elastic.run``; in
generation 0 rank 1 SIGKILLs itself (with ``spare``: once a warm spare ran its setup) and is restarted alone.
Every line names the rank, the generation and the process id.
"""

from __future__ import annotations

import os
import signal
import sys

from launch_logs_job import _wait_for


def aware(out: str, spare: bool) -> None:
    import torch
    import torch.distributed as dist

    import ckptd.elastic

    def setup() -> None:
        if os.environ.get("CKPTD_ELASTIC_SPARE") is not None:
            print(f"spare setup pid {os.getpid()}", flush=True)
            open(os.path.join(out, f"spare-{os.getpid()}"), "w").close()

    def train(ctx: ckptd.elastic.WorkerContext) -> None:
        print(f"out rank {ctx.rank} gen {ctx.generation} pid {os.getpid()}", flush=True)
        print(f"err rank {ctx.rank} gen {ctx.generation} pid {os.getpid()}", file=sys.stderr, flush=True)
        if ctx.rank == 1 and ctx.generation == 0:
            if spare:
                _wait_for(os.path.join(out, "spare-*"))
            os.kill(os.getpid(), signal.SIGKILL)
        for step in range(5):
            value = torch.ones(1)
            dist.all_reduce(value)
            ctx.heartbeat(step)

    ckptd.elastic.run(train, setup_fn=setup)


if __name__ == "__main__":
    aware(sys.argv[2], sys.argv[3:] == ["spare"])
