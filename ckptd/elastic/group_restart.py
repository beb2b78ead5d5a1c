"""Whole-group restarts for scripts that do not use :func:`ckptd.elastic.run` (torchrun's semantics).

A torchrun-style script (``init_process_group("gloo")`` through ``env://``, DDP, its own snapshot file) can only
be restarted as a whole group: its surviving ranks cannot leave a failed collective and rejoin in their
processes. Such a script also expects a fresh rendezvous per attempt: ``env://`` init under an agent's
store (``TORCHELASTIC_USE_AGENT_STORE``) connects to ``MASTER_ADDR:MASTER_PORT`` with no prefix, so a second
attempt on the same store reads the first attempt's keys (gloo then connects to the dead ranks' addresses).
torchrun starts a new store for every attempt; so does the supervisor: for each generation that restarts the
group, node 0's supervisor hosts a new ``TCPStore`` (:class:`AttemptStores`) and every rank of the attempt gets
its port as ``MASTER_PORT`` and the attempt (the generation) as ``TORCHELASTIC_RESTART_COUNT``.

Which mode applies is decided per failure: a job whose every rank sent a ckptd heartbeat (each rank of
:func:`ckptd.elastic.run` does, as soon as it enters a generation) restarts the failed rank alone; any other
job restarts the whole group. :func:`expected_mode` reads the script once at start to say which to expect.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptd.elastic.waiting import wait_for

log = logging.getLogger("ckptd.elastic")

_USES_ELASTIC = re.compile(r"ckptd\.elastic|from\s+ckptd\s+import\s+[^\n]*\belastic\b")


def group_key(generation: int) -> str:
    """Set (to ``"1"``) before ``generation`` starts when that generation restarts the whole group."""
    return f"elastic/group-restart/{generation}"


def event_key(generation: int) -> str:
    """Counts the supervisors that found a failure of ``generation``: the first one handles the event."""
    return f"elastic/group-event/{generation}"


def port_key(generation: int) -> str:
    """The port of the store node 0's supervisor hosts for the attempt of ``generation``."""
    return f"elastic/attempt-port/{generation}"


def _script_path(command: tuple[str, ...]) -> Path | None:
    arguments = list(command[2:] if tuple(command[1:2]) == ("-u",) else command[1:])
    if not arguments:
        return None
    if arguments[0] == "-m":
        try:
            found = importlib.util.find_spec(arguments[1]) if len(arguments) > 1 else None
        except (ImportError, ValueError):
            return None
        return Path(found.origin) if found is not None and found.origin not in (None, "built-in", "frozen") else None
    return Path(arguments[0])


def expected_mode(command: tuple[str, ...]) -> tuple[bool, str]:
    """(whether the script is expected to restart rank by rank, why) from its source text."""
    path = _script_path(command)
    try:
        text = path.read_text(encoding="utf-8", errors="replace") if path is not None else None
    except OSError:
        text = None
    if text is None:
        return False, f"its script could not be read ({command[1:3]})"
    if _USES_ELASTIC.search(text):
        return True, f"{path.name} uses ckptd.elastic"
    return False, f"{path.name} does not use ckptd.elastic"


class AttemptStores:
    """The per-attempt stores of whole-group restarts: node 0's supervisor hosts one per generation (keeping
    the current and the previous one), the others read its port from the job's store."""

    def __init__(self, job_store: Any, host: str, node_rank: int, timeout_s: float) -> None:
        self.job_store, self.host, self.node_rank, self.timeout_s = job_store, host, node_rank, timeout_s
        self._hosted: dict[int, Any] = {}

    def port(self, generation: int, on_poll: Any = None) -> int:
        """The port of ``generation``'s store: made here on node 0; elsewhere waited for (bounded, logged)."""
        if self.node_rank == 0:
            if generation not in self._hosted:
                store = dist.TCPStore(self.host, 0, None, True, timeout=timedelta(seconds=self.timeout_s),
                                      wait_for_workers=False)
                self._hosted[generation] = store
                for old in [old for old in self._hosted if old < generation - 1]:
                    del self._hosted[old]
                self.job_store.set(port_key(generation), str(store.port))
                log.info("node 0 hosts the rendezvous store of attempt %d at %s:%d", generation, self.host,
                         store.port)
            return int(self._hosted[generation].port)
        wait_for(lambda: self.job_store.check([port_key(generation)]),
                 what=f"node 0's supervisor to open the rendezvous store of attempt {generation}",
                 timeout_s=self.timeout_s, poll_s=0.05, on_poll=on_poll,
                 hint="node 0's supervisor may be lost: its log says why")
        return int(self.job_store.get(port_key(generation)))
