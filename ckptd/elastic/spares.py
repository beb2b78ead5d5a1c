"""Warm spares (``ckptd launch --spares N``): processes that import torch and run the script's setup before
they know their rank, then wait on the job's store to be given the rank of a failed process.

Supervisor side, :class:`SparePool` (one per node): :meth:`SparePool.fill` starts spares (the script with
``CKPTD_ELASTIC_SPARE=<id>`` and the job's variables but no rank), :meth:`SparePool.take` gives the
spare to hand a failed rank to (a ready one first: its setup is done), :meth:`SparePool.assign` writes the
rank's variables under ``elastic/spare/<node>/<id>/assign``; the spare's process becomes the rank's.

Worker side, :func:`become_rank` (called by :func:`ckptd.elastic.run` after the setup function): says
``ready`` and waits for the assignment, logging while it waits, until the job stops or ends (its
supervisor then stops it; it also dies with its supervisor). It puts the rank's variables into
``os.environ``, as if it had been started with them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptd.errors import GenerationEndedError
from ckptd.elastic import keys
from ckptd.elastic.log_routing import redirect_from_environment
from ckptd.elastic.preloaded import RankProcess

log = logging.getLogger("ckptd.elastic")

#: Seconds a waiting spare waits for its assignment before it looks whether the job stops and logs (its
#: supervisor stops it with SIGTERM when the job ends or stops).
_LOOK_S = 30.0


@dataclass
class Spare:
    """One warm spare process of this node."""

    ident: int
    process: RankProcess


class SparePool:
    """The warm spares of one node (see the module docstring). Supervisor thread only."""

    def __init__(self, store: Any, node_rank: int, count: int,
                 start: Callable[[dict[str, str]], RankProcess], first_ident: int = 0) -> None:
        self.store, self.node_rank, self.count, self._start = store, node_rank, count, start
        self.spares: list[Spare] = []
        self._next = first_ident

    def fill(self) -> None:
        """Start spares until ``count`` wait."""
        while len(self.spares) < self.count:
            ident, self._next = self._next, self._next + 1
            process = self._start({keys.ENV_SPARE: str(ident)})
            self.spares.append(Spare(ident, process))
            log.info("started warm spare %d (pid %d) on node %d", ident, process.pid, self.node_rank)

    def take(self) -> Spare | None:
        """A spare to hand a rank to, taken out of the pool: one whose setup is done first, else the oldest
        still starting (it has imported more than a new process would have); None when there is none."""
        self._drop_dead()
        ready = [spare for spare in self.spares if self.store.check([keys.spare_ready(self.node_rank, spare.ident)])]
        chosen = (ready or self.spares or [None])[0]
        if chosen is not None:
            self.spares.remove(chosen)
        return chosen

    def assign(self, spare: Spare, variables: dict[str, str]) -> None:
        """Give ``spare`` a rank: ``variables`` are that rank's environment variables."""
        self.store.set(keys.spare_assignment(self.node_rank, spare.ident), json.dumps(variables))

    def _drop_dead(self) -> None:
        for spare in list(self.spares):
            code = spare.process.poll()
            if code is not None:
                log.warning("warm spare %d (pid %d) exited with code %s before it was needed; dropped",
                            spare.ident, spare.process.pid, code)
                self.spares.remove(spare)

    def stop(self) -> None:
        """Stop every waiting spare (SIGTERM; they wait on the store, nothing to save)."""
        spares, self.spares = self.spares, []
        for spare in spares:
            if spare.process.poll() is None:
                spare.process.terminate()
        for spare in spares:
            try:
                spare.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                spare.process.kill()
                spare.process.wait()


def become_rank(environ: dict[str, str] | None = None) -> None:
    """In a spare (``CKPTD_ELASTIC_SPARE`` set): say ready, wait for a rank, and put its variables into
    ``os.environ`` (see the module docstring). Raises GenerationEndedError when the job stops first."""
    env = os.environ if environ is None else environ
    ident, node = int(env[keys.ENV_SPARE]), int(env.get("GROUP_RANK", "0"))
    host, _, port = env[keys.ENV_STORE].rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, timeout=timedelta(seconds=60))
    store.set(keys.spare_ready(node, ident), str(os.getpid()))
    assignment, waited_since = keys.spare_assignment(node, ident), time.monotonic()
    while True:
        try:  # the store answers as soon as the key is set
            store.wait([assignment], timedelta(seconds=_LOOK_S))
            break
        except dist.DistStoreError:
            pass
        if store.check([keys.STOP]):
            raise GenerationEndedError(f"warm spare {ident}: the job is stopping: {store.get(keys.STOP).decode()}")
        log.info("warm spare %d (pid %d) of node %d has waited %.0f s for a rank", ident, os.getpid(), node,
                 time.monotonic() - waited_since)
    variables = json.loads(store.get(assignment))
    env.pop(keys.ENV_SPARE, None)
    env.update(variables)
    redirect_from_environment(variables)  # from now on its output goes to the rank's files
    log.info("warm spare %d (pid %d) becomes rank %s in generation %s", ident, os.getpid(), variables["RANK"],
             variables[keys.ENV_GENERATION])
