"""Elastic recovery: ``ckptd launch`` restarts only the rank that failed and the others rejoin in-process.

- :class:`~ckptd.elastic.supervisor.Supervisor` (one per node, started by ``ckptd launch``) starts the
  node's ranks with torchrun's environment, watches them (exits and signals through ``waitpid``,
  heartbeats and a hang timeout through the job's c10d TCPStore) and, when one fails, raises the store's
  generation and starts that rank alone again.
- :func:`~ckptd.elastic.worker.run` is what the training script calls: it forms the process group of the
  current generation and, when a peer fails, leaves it and joins the next one in the same process.
- :func:`~ckptd.elastic.worker.heartbeat` tells the supervisor that a rank makes progress.
- :func:`~ckptd.elastic.restore_check.finite_tensors` is the default check after each restore; a poisoned
  copy is read again from a farther tier or rolled back to an older step.
- warm spares (``--spares N``, :mod:`ckptd.elastic.spares`) run ``run``'s ``setup_fn`` before they have a
  rank and take a failed rank's place.
"""

from __future__ import annotations

from ckptd.elastic.restore_check import RestoreCheck, finite_tensors
from ckptd.elastic.worker import WorkerContext, heartbeat, run

__all__ = ["RestoreCheck", "WorkerContext", "finite_tensors", "heartbeat", "run"]
