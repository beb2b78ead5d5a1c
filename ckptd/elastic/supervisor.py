"""The supervisor of one node: starts its ranks, watches them, and replaces only the rank that failed.

One :class:`Supervisor` runs per node (``ckptd launch``). Supervisors meet through the job's c10d
``TCPStore``, hosted by the node-rank-0 supervisor at ``--rdzv-endpoint``. Call order: construct, then
:meth:`Supervisor.run`, which returns once every rank of the job finished or raises when the job stops.

Its loop, every ``poll_s``:

- ``waitpid`` (``Popen.poll``) on each local rank: an exit with code 0 is a finished rank; any other exit
  or a signal is a failure;
- heartbeats: every rank writes ``elastic/beat/<rank>`` (:func:`ckptd.elastic.heartbeat`); a rank that beat
  (in the current generation, or in an older one it never left) and then stays silent for ``hang_timeout_s``
  (counted from its last beat or from the start of the current generation, whichever is later) before its
  training function returns is hung. When several ranks are silent (the peers of a hung rank block in a
  collective with it) the one whose process stopped running is the hung one: a thread of every rank
  rewrites ``elastic/alive/<rank>`` every 0.1 s, and a rank whose alive key stalled as well is frozen
  (SIGSTOP, or stuck where no thread of it runs) while its waiting peers still run; when none is frozen,
  the one furthest behind (fewest beats, then the longest silence). Its own supervisor
  SIGKILLs it, so that its peers see a connection reset at once, and it counts as failed;
- until every rank of the job sent a ckptd heartbeat (a script that does not use :func:`ckptd.elastic.run`),
  a failure restarts the whole group, as torchrun does, each attempt with a fresh rendezvous store and one
  restart charged per failure (:mod:`ckptd.elastic.group_restart`); otherwise:
- a failure raises the store's generation (``compare_set``, so two supervisors seeing one event raise it
  once) and starts the failed rank alone again in the new generation; the survivors rejoin it in-process
  (:func:`ckptd.elastic.run`). After ``max_restarts`` restarts of the job, or ``max_restarts_per_rank``
  restarts of one rank, the next failure (of any rank, or of that rank) stops it: the supervisor sets
  ``elastic/stop``, every supervisor stops its ranks, and :meth:`run` raises WorkerError (exit 12) naming
  the rank, its last step, the cause and the budget spent. ``crash_loop`` failures in a row with no step
  completed in between (no rank's save or heartbeat named a step in the generation that failed) stop it
  the same way with CrashLoopError (exit 14). Back-off: a restart waits ``restart_backoff_s``, doubled
  at each further failure, after a failure in such a run, or after a failure of a rank that completed no
  step since its previous restart (a rank that keeps dying at start while the others train).
- with ``spares`` (``--spares N``) N warm spares wait on the node (:mod:`ckptd.elastic.spares`): a failed
  rank is handed to one (its process becomes the rank's) instead of a new process, and a new spare
  starts in the background.
- nodes: every supervisor beats ``elastic/node-beat/<node>`` every ``_NODE_BEAT_S`` and reads the others'.
  A node whose supervisor stays silent for ``node_timeout_s`` before it finished is lost: the generation
  goes up (its survivors leave the failed generation) and the job waits up to ``join_timeout_s`` for a new
  supervisor started with the lost ``--node-rank``; then it stops (WorkerError). A supervisor that joins a
  running job (its node rank joined before: the store's ``elastic/node-incarnation/<node>`` counts them)
  is such a replacement: it charges each of its ranks a restart, raises the generation and starts its
  ranks in it; the survivors keep their processes. A supervisor that sees a newer one of its node rank
  stops its ranks and exits.
- SIGTERM or SIGINT (``stop_signals``: torchrun's ``--signals-to-handle``) to any supervisor stops the whole job gracefully: it sets ``elastic/stop``, every rank
  leaves at its next step (:func:`ckptd.elastic.run` exits with code 15), every supervisor waits
  ``_LEAVE_GRACE_S`` (20 s) for its ranks before SIGTERM, and 5 s more before SIGKILL, and every
  supervisor exits with JobStoppedError (exit 15). Committed steps are kept.
- node 0's supervisor hosts the job's store: when it is lost the job ends. Every other supervisor stops its
  ranks and exits with WorkerError (exit 12) saying so and what to do: start the job again on every node;
  it resumes from the newest step committed for every rank. There is no store fail-over. With ``checkpoint_on_stop``
  (``--checkpoint-on-stop``) the stop takes a final checkpoint first: every rank saves one agreed step, waits
  for its commit and closes its managers (the object tier gets the step), then leaves
  (:mod:`ckptd.elastic.stop_checkpoint`); the supervisors wait ``stop_timeout_s`` for that instead of 20 s.

- logs: torchrun's ``--log-dir``, ``--redirects``, ``--tee`` and ``--local-ranks-filter`` route each rank's
  stdout and stderr (:mod:`ckptd.elastic.log_routing`): a whole-group restart opens a new ``attempt_<N>``
  folder; a rank restarted alone, or the spare given its rank, appends to the rank's files; the loop copies
  teed files to the console, prefixed.

Exit codes of ``ckptd launch``: 0 (every rank finished), 12 (a restart budget spent, a lost node not
replaced in time, or a supervisor replaced by a newer one), 14 (crash loop), 15 (stopped on request).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckptd.config import settings
from ckptd.errors import ConfigError, CrashLoopError, JobStoppedError, WorkerError
from ckptd.elastic import group_restart, keys, log_routing
from ckptd.elastic.log_routing import LogRouter, LogSpec
from ckptd.elastic.preloaded import PreloadedStarter, RankProcess, die_with_parent
from ckptd.elastic.spares import SparePool
from ckptd.elastic.waiting import wait_for
from ckptd.elastic.worker import collective_timeout_s

log = logging.getLogger("ckptd.elastic")

#: Seconds a supervisor gives its ranks to leave a stopping job on their own (at their next step).
_LEAVE_GRACE_S = 20.0
#: Seconds a stopping supervisor gives its ranks between SIGTERM and SIGKILL.
_TERM_GRACE_S = 5.0
#: Seconds between two supervisor heartbeats (and two looks at the other nodes' heartbeats).
_NODE_BEAT_S = 0.1
#: Seconds a rank's alive key may stand still before its process counts as frozen (at most half the hang timeout).
_FROZEN_S = 2.0


@dataclass(frozen=True)
class LaunchSpec:
    """What ``ckptd launch`` was asked to run (torchrun's options)."""

    command: tuple[str, ...]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int = 29400
    max_restarts: int = 3
    #: Restarts each rank may spend (None: only the job's ``max_restarts`` bounds them).
    max_restarts_per_rank: int | None = None
    hang_timeout_s: float = 300.0
    #: Failures in a row with no step completed in between that stop the job (CrashLoopError); 0: never.
    crash_loop: int = 3
    #: Seconds before restarting a rank after the first failure of a crash loop, doubled at each next one.
    restart_backoff_s: float = 0.0
    #: Warm spares kept on this node (processes that ran the script's setup and wait for a failed rank).
    spares: int = 0
    #: Seconds the supervisors wait for each other (at start, for a lost node's replacement, and at the end).
    join_timeout_s: float = 300.0
    #: Seconds without a supervisor heartbeat after which the other nodes take that node for lost.
    node_timeout_s: float = 30.0
    poll_s: float = 0.01
    #: A stop (SIGTERM or SIGINT) first has every rank save and commit one agreed step.
    checkpoint_on_stop: bool = False
    #: Fork ranks and spares from a per-node process that imported torch once (:mod:`ckptd.elastic.preloaded`).
    preload: bool = True
    #: Seconds the ranks of a stopping job get to leave on their own (their final checkpoint, with
    #: ``checkpoint_on_stop``) before SIGTERM; without ``checkpoint_on_stop`` 20 s.
    stop_timeout_s: float = 120.0
    #: Signals that stop the job gracefully (torchrun's ``--signals-to-handle``).
    stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
    #: Seconds between SIGTERM and SIGKILL when the supervisor ends its ranks (torchrun's ``--shutdown-timeout``).
    term_grace_s: float = _TERM_GRACE_S
    #: The workers' role (torchrun's ``--role``: ``ROLE_NAME``) and the job's id (``--rdzv-id``:
    #: ``TORCHELASTIC_RUN_ID``).
    role: str = "default"
    run_id: str = "none"
    #: torchrun's ``--log-dir``, ``--redirects``, ``--tee``, ``--local-ranks-filter``
    #: (:mod:`ckptd.elastic.log_routing`).
    logs: LogSpec = field(default_factory=LogSpec)

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} and --nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1}")
        if min(self.max_restarts, self.hang_timeout_s, self.crash_loop, self.restart_backoff_s,
               0 if self.max_restarts_per_rank is None else self.max_restarts_per_rank, self.spares) < 0:
            raise ConfigError("--max-restarts, --max-restarts-per-rank, --spares, --hang-timeout, --crash-loop and "
                              "--restart-backoff must not be negative")
        if self.stop_timeout_s <= 0:
            raise ConfigError(f"--stop-timeout {self.stop_timeout_s:g} must be above 0")
        if self.node_timeout_s <= 0:
            raise ConfigError(f"--node-timeout {self.node_timeout_s:g} must be above 0")
        if not self.command:
            raise ConfigError("no training script given", hint="ckptd launch [options] script.py [args]")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def ranks_of(self, node_rank: int) -> list[int]:
        return [node_rank * self.nproc_per_node + local for local in range(self.nproc_per_node)]


@dataclass
class _Rank:
    """One local rank: its current process and how it was started."""

    rank: int
    local_rank: int
    process: RankProcess | None = None
    restarts: int = 0
    #: The generation its current process was started in.
    generation: int = 0
    #: This rank's failures in a row with no step completed by it in between (its back-off doubles with them).
    looping: int = 0
    hung_for: float | None = None  # set when this supervisor killed it as hung
    finished: bool = False
    start_at: float | None = None  # a restart waiting out its back-off (time.monotonic())


@dataclass
class _Beats:
    """What the supervisor saw of one rank's heartbeat: the value, and when it last changed (local clock)."""

    value: tuple[int, int, int, int] = keys.parse_beat(keys.NO_BEAT)
    changed: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts and watches the ranks of one node (see the module docstring)."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.ranks = [_Rank(spec.global_rank(local), local) for local in range(spec.nproc_per_node)]
        self.generation = 0
        self.store: Any = None
        self._beats = {rank: _Beats() for rank in range(spec.world_size)}
        #: Each rank's :func:`keys.alive` value and when it last changed (local clock).
        self._alive: dict[int, tuple[bytes, float]] = {}
        #: (rank, generation) of ranks said to be blocked in an ended generation (logged once each).
        self._said_blocked: set[tuple[int, int]] = set()
        #: Ranks seen sending a ckptd heartbeat (ckptd.elastic.run); until all have, a failure restarts the group.
        self._aware: set[int] = set()
        #: The stores of whole-group restarts (:mod:`ckptd.elastic.group_restart`), made once connected.
        self._attempts: group_restart.AttemptStores | None = None
        #: The attempt (generation) the ranks were last started in by a whole-group restart, its store's port,
        #: and when it started (local clock).
        self._group_attempt: int | None = None
        self._master_port: int | None = None
        self._attempt_started = time.monotonic()
        self._spares: SparePool | None = None  # made once the store is connected
        #: The newest step each rank reported completing, in any generation (-1: none).
        self._last_step = {rank: -1 for rank in range(spec.world_size)}
        #: This supervisor's number among those that joined with its node rank (1: the first; more: a replacement).
        self.incarnation = 0
        self._node_sequence = 0
        self._next_node_beat = 0.0
        #: The other nodes' heartbeats: the value, and when it last changed (local clock).
        self._nodes: dict[int, tuple[bytes, float]] = {}
        #: Nodes taken for lost, and since when (local clock), until a new supervisor of theirs beats.
        self._lost: dict[int, float] = {}
        self._signalled: int | None = None  # SIGTERM or SIGINT received
        self._handlers: dict[int, Any] = {}  # the signal handlers this supervisor replaced
        self._starter: PreloadedStarter | None = None  # with spec.preload, made and warmed before joining
        self._logs = LogRouter(spec.logs, spec.run_id, spec.role, {rank.local_rank: rank.rank for rank in self.ranks})
        if self._logs.run_dir is not None:
            log.info("the ranks' logs go under %s (attempt_<N>/<local rank>/stdout.log, stderr.log)",
                     self._logs.run_dir)

    # --- start ----------------------------------------------------------------------------------
    def _connect(self) -> None:
        spec = self.spec
        is_host = spec.node_rank == 0
        self.store = dist.TCPStore(spec.rdzv_host, spec.rdzv_port, None, is_host,
                                   timeout=timedelta(seconds=spec.join_timeout_s), wait_for_workers=False)
        # from now on there is a job to stop gracefully (until now SIGTERM ends the process at once)
        self._handlers = self._catch_stop_signals()
        if is_host:
            self.store.set(keys.GENERATION, "0")
            for rank in range(spec.world_size):
                self.store.set(keys.beat(rank), keys.NO_BEAT)
                self.store.set(keys.alive(rank), keys.NOT_ALIVE_YET)
            for node in range(spec.nnodes):
                self.store.set(keys.node_beat(node), "0:0")
            self.store.set(keys.OPEN, "1")
        wait_for(lambda: self.store.check([keys.OPEN]), what="the node-rank-0 supervisor to open the job store",
                 timeout_s=spec.join_timeout_s, poll_s=0.1, on_poll=self._check_signalled)
        self.incarnation = int(self.store.add(keys.node_incarnation(spec.node_rank), 1))
        self._beat_node()
        if self.incarnation > 1:
            self._replace_lost_node()
            return
        self.store.add(keys.NODES, 1)
        wait_for(lambda: int(self.store.add(keys.NODES, 0)) >= spec.nnodes,
                 what=f"{spec.nnodes} supervisors to join at {spec.rdzv_host}:{spec.rdzv_port}",
                 timeout_s=spec.join_timeout_s, poll_s=0.1, on_poll=self._check_signalled,
                 hint="start `ckptd launch` with the same --rdzv-endpoint on every node")

    def _replace_lost_node(self) -> None:
        """This supervisor joins a running job in place of a lost one of its node rank: its ranks count a
        restart each, and they start in a new generation, which the survivors join in their processes."""
        spec = self.spec
        current = int(self.store.get(keys.GENERATION))
        # compare_set: when a survivor's supervisor raised it for this loss at the same moment, keep theirs
        self._enter_generation(int(self.store.compare_set(keys.GENERATION, str(current), str(current + 1))))
        spent = int(self.store.add(keys.RESTARTS, len(self.ranks)))
        for rank in self.ranks:
            rank.restarts = int(self.store.add(keys.rank_restarts(rank.rank), 1))
        numbers = [rank.rank for rank in self.ranks]
        log.warning("node %d joins the running job in place of a lost supervisor (the node's supervisor %d): "
                    "starting ranks %s in generation %d (restarts %d of %d)", spec.node_rank, self.incarnation,
                    numbers, self.generation, spent, spec.max_restarts)
        cause = f"lost with its node {spec.node_rank}"
        if spent > spec.max_restarts:
            self._stop_job(self.ranks[0], cause, WorkerError, f"node {spec.node_rank} (ranks {numbers}) was lost "
                           f"and replaced, and the job's --max-restarts {spec.max_restarts} are spent")
        per_rank = spec.max_restarts_per_rank
        over = [rank for rank in self.ranks if per_rank is not None and rank.restarts > per_rank]
        if over:
            self._stop_job(over[0], cause, WorkerError, f"node {spec.node_rank} was lost and replaced, and rank "
                           f"{over[0].rank}'s --max-restarts-per-rank {per_rank} are spent")

    def _job_variables(self) -> dict[str, str]:
        """The environment variables every process of this node gets, spares included."""
        spec = self.spec
        return {
            "WORLD_SIZE": str(spec.world_size), "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
            "GROUP_RANK": str(spec.node_rank), "ROLE_WORLD_SIZE": str(spec.world_size),
            "GROUP_WORLD_SIZE": str(spec.nnodes), "MASTER_ADDR": spec.rdzv_host,
            "MASTER_PORT": str(spec.rdzv_port if self._master_port is None else self._master_port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "ROLE_NAME": spec.role, "TORCHELASTIC_RUN_ID": spec.run_id,
            keys.ENV_STORE: f"{spec.rdzv_host}:{spec.rdzv_port}", keys.ENV_HANG_TIMEOUT: str(spec.hang_timeout_s),
            keys.ENV_CHECKPOINT_ON_STOP: "1" if spec.checkpoint_on_stop else "0",
        }

    def _rank_variables(self, rank: _Rank) -> dict[str, str]:
        """The variables that make a process ``rank`` in the current generation (a spare gets them later)."""
        return {
            "RANK": str(rank.rank), "LOCAL_RANK": str(rank.local_rank), "ROLE_RANK": str(rank.rank),
            # after a whole-group restart every rank has the attempt's number, as under torchrun
            "TORCHELASTIC_RESTART_COUNT": str(rank.restarts if self._group_attempt is None else self._group_attempt), keys.ENV_GENERATION: str(self.generation),
            keys.ENV_RESTART_COUNT: str(rank.restarts), **self._logs.variables(rank.local_rank),
        }

    def _job_environment(self) -> dict[str, str]:
        """This process's environment with :meth:`_job_variables`: what every rank and spare starts from."""
        return {**os.environ, **self._job_variables()}

    def _spawn(self, variables: dict[str, str]) -> RankProcess:
        job = self._job_environment()
        if self._starter is not None:
            return self._starter.start(self.spec.command, {**job, **variables})
        files = [open(path, "ab") if (path := variables.get(name)) else None  # noqa: SIM115 - closed below
                 for name in (log_routing.ENV_STDOUT, log_routing.ENV_STDERR)]
        try:
            return subprocess.Popen(list(self.spec.command), env={**job, **variables}, stdout=files[0],
                                    stderr=files[1], preexec_fn=die_with_parent if sys.platform == "linux" else None)
        finally:
            for opened in files:
                if opened is not None:
                    opened.close()

    def _start(self, rank: _Rank) -> None:
        rank.hung_for, rank.finished, rank.start_at, rank.generation = None, False, None, self.generation
        # the new process is not judged by the old one's beats
        self.store.set(keys.beat(rank.rank), keys.NO_BEAT)
        self._beats[rank.rank] = _Beats()
        spare = self._spares.take() if self._spares is not None and rank.restarts else None
        if spare is None:
            rank.process = self._spawn(self._rank_variables(rank))
            log.info("started rank %d (pid %d) in generation %d", rank.rank, rank.process.pid, self.generation)
            return
        self._spares.assign(spare, self._rank_variables(rank))
        rank.process = spare.process
        log.info("handed rank %d to warm spare %d (pid %d) in generation %d", rank.rank, spare.ident,
                 spare.process.pid, self.generation)
        # a new spare starts once this rank completed a step (see run): its start would slow the recovery

    # --- watch ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Start the node's ranks and watch them until the job finishes; raises WorkerError when it stops."""
        try:
            if self.spec.preload:  # before the first heartbeat: the imports take seconds
                self._starter = PreloadedStarter(self._job_environment())
                self._starter.warm(self.spec.join_timeout_s)
            self._connect()
            self._supervise()
        except WorkerError:
            self._say_stopped()
            raise
        except dist.DistError as error:  # the store's host, node 0, is gone: this job cannot go on
            if self.store is None or self.spec.node_rank == 0:
                raise
            raise self._store_lost(error) from error
        finally:
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)

    def _store_lost(self, error: BaseException) -> WorkerError:
        """The error a supervisor other than node 0's exits with once the job's store stopped answering."""
        spec = self.spec
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return WorkerError(
            f"node {spec.node_rank}: the job's store at {spec.rdzv_host}:{spec.rdzv_port}, hosted by node 0's "
            f"supervisor, stopped answering ({first}): node 0 is lost, and with it the job (the store does not "
            f"fail over); this node stopped its ranks {[rank.rank for rank in self.ranks]}",
            hint="start the job again: `ckptd launch` with the same options on every node (node 0 first, a new "
                 "machine may take its place); every rank resumes from the newest step committed for all of them")

    def _catch_stop_signals(self) -> dict[int, Any]:
        """SIGTERM and SIGINT stop the job gracefully (see the module docstring), from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def caught(signum: int, frame: Any) -> None:
            self._signalled = signum

        return {signum: signal.signal(signum, caught) for signum in self.spec.stop_signals}

    def _check_signalled(self) -> None:
        """After SIGTERM or SIGINT: ask every supervisor to stop the job, then stop (JobStoppedError)."""
        if self._signalled is None:
            return
        name = signal.Signals(self._signalled).name
        if self.store is not None and not self.store.check([keys.STOP]):
            message = f"node {self.spec.node_rank}'s supervisor got {name}"
            checkpoint = self.spec.checkpoint_on_stop
            self.store.set(keys.STOP, json.dumps({
                "rank": -1, "cause": name, "message": message, "stopped": True, "checkpoint": checkpoint,
                "grace_s": self.spec.stop_timeout_s if checkpoint else _LEAVE_GRACE_S}))
            log.warning("%s: stopping the job; %s", message, "every rank saves a final checkpoint at its next step, "
                        f"then leaves (--stop-timeout {self.spec.stop_timeout_s:g} s)" if checkpoint
                        else "every rank leaves at its next step")
        self._check_stop()
        raise JobStoppedError(f"the job stopped: node {self.spec.node_rank}'s supervisor got {name}")

    def _supervise(self) -> None:
        # a replacement's spares are numbered apart from the lost supervisor's, whose keys stay in the store
        self._spares = SparePool(self.store, self.spec.node_rank, self.spec.spares, self._spawn,
                                 first_ident=1000 * (self.incarnation - 1))
        self._attempts = group_restart.AttemptStores(self.store, self.spec.rdzv_host, self.spec.node_rank,
                                                     self.spec.join_timeout_s)
        self._say_recovery_mode()
        self._logs.open_attempt(self._group_attempt or 0)
        for rank in self.ranks:
            self._start(rank)
        self._attempt_started = time.monotonic()
        try:
            self._spares.fill()
            while True:
                self._follow_generation()
                self._check_signalled()
                self._check_stop()
                self._watch_nodes()
                self._read_beats()
                failed = [(rank, cause) for rank in self.ranks if (cause := self._check_exit(rank)) is not None]
                if failed:
                    self._recover(failed)
                for rank in self.ranks:
                    if rank.start_at is not None and time.monotonic() >= rank.start_at:
                        self._start(rank)
                if all(rank.finished for rank in self.ranks):
                    break
                if self._recovered():
                    self._spares.fill()
                self._check_hangs()
                self._logs.pump()
                time.sleep(self.spec.poll_s)
            self._spares.stop()
            self._finish()
        except BaseException:
            self._stop_ranks()
            raise
        finally:
            if self._spares is not None:
                self._spares.stop()
            self._logs.close()

    def _recovered(self) -> bool:
        """Whether every local rank completed a step in the current generation (or finished)."""
        return all(rank.finished or (self._beats[rank.rank].value[0] == self.generation and
                                     self._beats[rank.rank].value[3] >= 0) for rank in self.ranks)

    def _follow_generation(self) -> None:
        current = int(self.store.get(keys.GENERATION))
        if current != self.generation:
            self._enter_generation(current)
            if self.store.check([group_restart.group_key(current)]):
                self._restart_local_group(current)

    def _say_recovery_mode(self) -> None:
        """Once, at start: which recovery to expect, and why."""
        by_rank, why = group_restart.expected_mode(self.spec.command)
        if by_rank:
            log.info("recovery: rank by rank (%s): a failed rank is restarted alone and its peers rejoin in their "
                     "processes, once every rank sent its first ckptd heartbeat (until then a failure restarts "
                     "the whole group)", why)
        else:
            log.info("recovery: the whole group, as torchrun (%s): a failure of any rank stops every rank and "
                     "starts them all again, each attempt with a fresh rendezvous store (MASTER_PORT) and "
                     "TORCHELASTIC_RESTART_COUNT; each failure costs one of --max-restarts %d; --crash-loop does "
                     "not apply (the script reports no steps to ckptd)", why, self.spec.max_restarts)

    def _recover_group(self, failed: list[tuple[_Rank, str]]) -> None:
        """A rank of a job that is not (yet) ckptd-aware failed: the first supervisor to see this generation's
        failure charges one restart and starts the next generation as a whole-group restart; every
        supervisor then stops its ranks and starts them all again (:meth:`_restart_local_group`)."""
        spec = self.spec
        failed_in = int(self.store.get(keys.GENERATION))
        if failed_in != self.generation:
            return  # a newer generation is under way: the next round follows it (its ranks start again)
        if int(self.store.add(group_restart.event_key(failed_in), 1)) != 1:
            wait_for(lambda: int(self.store.get(keys.GENERATION)) > failed_in,
                     what=f"the supervisor that found generation {failed_in}'s failure to start the next attempt",
                     timeout_s=spec.join_timeout_s, poll_s=0.01, on_poll=self._check_signalled)
            self._follow_generation()
            return
        rank, cause = failed[0]
        spent = int(self.store.add(keys.RESTARTS, 1))
        last = self._last_step[rank.rank]
        where = (f"in generation {failed_in}, {time.monotonic() - self._attempt_started:.1f} s into the attempt, "
                 + (f"its last step {last}" if last >= 0 else "a script that reports no steps to ckptd"))
        also = "".join(f"; rank {other.rank} {other_cause}" for other, other_cause in failed[1:])
        if spent > spec.max_restarts:
            self._stop_job(rank, cause, WorkerError, f"rank {rank.rank} {cause} ({where}){also}, and the job's "
                           f"--max-restarts {spec.max_restarts} are spent")
        self.store.set(group_restart.group_key(failed_in + 1), "1")
        current = int(self.store.compare_set(keys.GENERATION, str(failed_in), str(failed_in + 1)))
        log.warning("rank %d (pid %s) %s (%s)%s; restarting the whole group (ranks 0-%d) in generation %d with a "
                    "fresh rendezvous store, as torchrun does (restart %d of %d)", rank.rank,
                    rank.process.pid if rank.process else None, cause, where, also, spec.world_size - 1, current,
                    spent, spec.max_restarts)
        self._enter_generation(current)
        if self.store.check([group_restart.group_key(current)]):
            self._restart_local_group(current)

    def _restart_local_group(self, generation: int) -> None:
        """Stop this node's ranks (SIGTERM, SIGKILL after ``term_grace_s``) and start them all in ``generation``
        with its attempt's store."""
        started = time.monotonic()
        running = [rank for rank in self.ranks if rank.process is not None and rank.process.poll() is None]
        for rank in running:
            rank.process.send_signal(signal.SIGTERM)
        for rank in running:
            try:
                rank.process.wait(timeout=max(0.0, started + self.spec.term_grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d (pid %d) did not end within %g s of SIGTERM: SIGKILL", rank.rank,
                            rank.process.pid, self.spec.term_grace_s)
                rank.process.kill()
                rank.process.wait(timeout=self.spec.term_grace_s)
        if self._attempts is None:  # made in _supervise, before any rank can fail
            self._attempts = group_restart.AttemptStores(self.store, self.spec.rdzv_host, self.spec.node_rank,
                                                         self.spec.join_timeout_s)
        self._master_port = self._attempts.port(generation, on_poll=self._check_signalled)
        self._group_attempt = generation
        self._logs.open_attempt(generation)
        log.info("node %d: ranks %s stopped in %.2f s (%d still ran); starting them all in generation %d, "
                 "rendezvous at %s:%d", self.spec.node_rank, [rank.rank for rank in self.ranks],
                 time.monotonic() - started, len(running), generation, self.spec.rdzv_host, self._master_port)
        for rank in self.ranks:
            rank.restarts += 1
            self._start(rank)
        self._attempt_started = time.monotonic()

    def _enter_generation(self, generation: int) -> None:
        """Follow the job into ``generation``: the hang timeout counts from now for every rank."""
        self.generation = generation
        now = time.monotonic()
        for beats in self._beats.values():
            beats.changed = now

    def _check_stop(self) -> None:
        if self.store.check([keys.STOP]):
            reason = json.loads(self.store.get(keys.STOP))
            if reason.get("stopped"):
                raise JobStoppedError(f"the job stopped: {reason['message']}; every rank left at its next step, "
                                      "committed steps are kept", hint="launch the job again to resume")
            kind = CrashLoopError if reason.get("crash_loop") else WorkerError
            raise kind(f"the job stopped: {reason['message']}", {int(reason["rank"]): reason["cause"]})

    # --- nodes ----------------------------------------------------------------------------------
    def _beat_node(self) -> None:
        self._node_sequence += 1
        self.store.set(keys.node_beat(self.spec.node_rank), f"{self.incarnation}:{self._node_sequence}")

    def _watch_nodes(self) -> None:
        """Beat this supervisor's heartbeat; find lost nodes and their replacements (module docstring)."""
        now = time.monotonic()
        if now < self._next_node_beat:
            return
        self._next_node_beat = now + _NODE_BEAT_S
        spec = self.spec
        self._beat_node()
        others = [node for node in range(spec.nnodes) if node != spec.node_rank]
        values = self.store.multi_get([keys.node_incarnation(spec.node_rank),
                                       *(keys.node_beat(node) for node in others)])
        newest = int(values[0])
        if newest != self.incarnation:
            raise WorkerError(f"node {spec.node_rank}: a newer supervisor with --node-rank {spec.node_rank} joined "
                              f"the job (the node's supervisor {newest}, this is {self.incarnation}): this one "
                              "stops its ranks", hint="run one `ckptd launch` per node rank")
        for node, value in zip(others, values[1:]):
            seen = self._nodes.get(node)
            if seen is None or seen[0] != value:
                self._nodes[node] = (value, now)
                if node in self._lost:
                    log.warning("node %d's supervisor beats again (supervisor %s of the node)", node,
                                value.decode().split(":")[0])
                    del self._lost[node]
                continue
            if node in self._lost:
                if now - self._lost[node] > spec.join_timeout_s:
                    self._stop_job(_Rank(spec.ranks_of(node)[0], 0), f"lost with its node {node}", WorkerError,
                                   f"node {node} (ranks {spec.ranks_of(node)}) was lost and no new supervisor "
                                   f"with --node-rank {node} joined within {spec.join_timeout_s:g} s")
                continue
            silent = now - seen[1]
            if value.startswith(b"0:") or silent <= spec.node_timeout_s or self.store.check([keys.node_done(node)]):
                continue
            self._lost[node] = now
            failed_in = self.generation
            self._enter_generation(int(self.store.compare_set(keys.GENERATION, str(failed_in), str(failed_in + 1))))
            log.warning("node %d's supervisor sent no heartbeat for %.1f s: node %d and its ranks %s are lost; "
                        "the survivors leave generation %d for generation %d and wait up to %g s for a new "
                        "supervisor started with --node-rank %d", node, silent, node, spec.ranks_of(node),
                        failed_in, self.generation, spec.join_timeout_s, node)

    def _lost_ranks(self) -> set[int]:
        return {rank for node in self._lost for rank in self.spec.ranks_of(node)}

    def _check_exit(self, rank: _Rank) -> str | None:
        """The cause when the rank's process failed (None while it runs, once it finished, or waits to start)."""
        if rank.finished or rank.process is None or rank.start_at is not None:
            return None
        code = rank.process.poll()  # waitpid(pid, WNOHANG)
        if code is None:
            return None
        if code == 0:
            rank.finished = True
            log.info("rank %d finished", rank.rank)
            return None
        if code == keys.EXIT_STOPPED and self.store.check([keys.STOP]):
            return None  # it left a stopping job: _check_stop stops this supervisor next
        if rank.hung_for is not None:
            return f"hung (no heartbeat for {rank.hung_for:.1f} s), killed with SIGKILL"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def _recover(self, failed: list[tuple[_Rank, str]]) -> None:
        """Ranks failed (found in one round): raise the generation once and start them again in it (the whole
        group, while not every rank of the job is known to run ckptd.elastic.run)."""
        if self._every_rank_done(self.generation):
            for rank, cause in failed:
                log.warning("rank %d (pid %s) %s after every rank finished; the job is complete", rank.rank,
                            rank.process.pid if rank.process else None, cause)
                rank.finished = True
            return
        if len(self._aware) < self.spec.world_size:
            self._recover_group(failed)
            return
        failed_in = int(self.store.get(keys.GENERATION))
        self._read_beats()
        # the generation each dead process was in (started in, or rejoined): a process that never reached the
        # current generation died with the failure that raised it, and is counted with it, not as a crash loop
        died_in = {rank.rank: max(rank.generation, self._beats[rank.rank].value[0]) for rank, _ in failed}
        newest = max(died_in.values())
        looping = self._crash_loop(newest) if self._charge(newest) else int(self.store.add(keys.CRASH_LOOP, 0))
        described: list[tuple[str, str, float]] = []
        for rank, cause in failed:
            beaten = self._beats[rank.rank].value
            own_generation = died_in[rank.rank]
            rank.looping = 0 if beaten[0] == own_generation and beaten[3] >= 0 else rank.looping + 1
            in_a_row = max(looping, rank.looping)
            delay = self.spec.restart_backoff_s * 2 ** (in_a_row - 1) if in_a_row else 0.0
            last = self._last_step[rank.rank]
            where = f"in generation {own_generation} " + (f"(its last step {last})" if last >= 0 else
                                                          "(before completing a step)")
            if self.spec.crash_loop and looping >= self.spec.crash_loop:
                self._stop_job(rank, cause, CrashLoopError, f"rank {rank.rank} {cause} {where}: {looping} "
                               f"failure(s) in a row with no step completed in between (--crash-loop "
                               f"{self.spec.crash_loop})")
            per_rank = self.spec.max_restarts_per_rank
            if per_rank is not None and rank.restarts >= per_rank:
                self._stop_job(rank, cause, WorkerError, f"rank {rank.rank} {cause} {where}, and its "
                               f"--max-restarts-per-rank {per_rank} are spent")
            spent = int(self.store.add(keys.RESTARTS, 1))
            if spent > self.spec.max_restarts:
                self._stop_job(rank, cause, WorkerError, f"rank {rank.rank} {cause} {where}, and the job's "
                               f"--max-restarts {self.spec.max_restarts} are spent")
            own = "" if per_rank is None else f", the rank's {rank.restarts + 1} of {per_rank}"
            described.append((f"rank {rank.rank} (pid {rank.process.pid if rank.process else None}) {cause} "
                              f"{where}", f"(restart {spent} of {self.spec.max_restarts}{own})", delay))
        # compare_set: when another supervisor raised it at the same moment (another rank failed), keep theirs
        self._enter_generation(int(self.store.compare_set(keys.GENERATION, str(failed_in), str(failed_in + 1))))
        for what, budget, delay in described:
            log.warning("%s; restarting it alone in generation %d%s %s", what, self.generation,
                        f" in {delay:g} s" if delay else "", budget)
        for (rank, _), (_, _, delay) in zip(failed, described):
            rank.restarts += 1
            self.store.add(keys.rank_restarts(rank.rank), 1)
            if delay:
                rank.process, rank.start_at = None, time.monotonic() + delay
            else:
                self._start(rank)

    def _charge(self, generation: int) -> bool:
        """Whether a failure of a process of ``generation`` is a new event: no failure of that generation or a
        later one was counted yet, by this supervisor or another (one claim per generation: the first
        ``add`` wins)."""
        if generation <= int(self.store.compare_set(keys.CRASH_LOOP_CHARGED, "", "-1")):
            return False
        if int(self.store.add(f"{keys.CRASH_LOOP_CHARGED}/{generation}", 1)) != 1:
            return False
        while True:  # raise the newest counted generation to this one, unless another supervisor went past it
            current = self.store.compare_set(keys.CRASH_LOOP_CHARGED, "", "-1")
            if int(current) >= generation or self.store.compare_set(
                    keys.CRASH_LOOP_CHARGED, current, str(generation)) == str(generation).encode():
                return True

    def _crash_loop(self, generation: int) -> int:
        """Count this failure: the failures in a row with no step completed in between, this one included."""
        completed = any(beats.value[0] == generation and beats.value[3] >= 0 for beats in self._beats.values())
        if completed:
            self.store.set(keys.CRASH_LOOP, "0")
            return 0
        return int(self.store.add(keys.CRASH_LOOP, 1))

    def _stop_job(self, rank: _Rank, cause: str, kind: type[WorkerError], message: str) -> None:
        self.store.set(keys.STOP, json.dumps({"rank": rank.rank, "cause": cause, "message": message,
                                              "crash_loop": kind is CrashLoopError}))
        raise kind(f"the job stopped: {message}", {rank.rank: cause})

    def _every_rank_done(self, generation: int) -> bool:
        return bool(self.store.check([keys.in_generation(generation, keys.done(other))
                                      for other in range(self.spec.world_size)]))

    def _read_beats(self) -> None:
        now = time.monotonic()
        world = self.spec.world_size
        values = self.store.multi_get([keys.beat(rank) for rank in range(world)] +
                                      [keys.alive(rank) for rank in range(world)])
        for rank, raw in enumerate(values[world:]):
            seen_alive = self._alive.get(rank)
            if seen_alive is None or seen_alive[0] != raw:
                self._alive[rank] = (raw, now)
        for rank, raw in enumerate(values[:world]):
            seen, value = self._beats[rank], keys.parse_beat(raw)
            if value[0] >= 0:
                self._aware.add(rank)
            if value != seen.value:
                seen.value, seen.changed = value, now
                self._last_step[rank] = max(self._last_step[rank], value[3])

    def _check_hangs(self) -> None:
        if not self.spec.hang_timeout_s:
            return
        now = time.monotonic()
        silent: list[tuple[int, float, int]] = []  # (progress, last change, rank)
        lost = self._lost_ranks()
        for rank, seen in self._beats.items():
            if rank in lost:  # gone with its node, not hung
                continue
            generation, progress = seen.value[:2]
            # an older generation counts too: a rank stuck in a generation that moved on never beats in the new one
            if generation <= self.generation and progress > 0 and now - seen.changed > self.spec.hang_timeout_s:
                silent.append((progress, seen.changed, rank))
        if not silent:
            return
        # a rank whose process stopped running (its alive key stalled too) is the hung one; its peers, blocked in
        # a collective with it, still run. Only when none is frozen (a loop that never beats, say): the one
        # furthest behind, then the longest silent
        stall_s = min(_FROZEN_S, self.spec.hang_timeout_s / 2)
        frozen = [entry for entry in silent if self._frozen(entry[2], now, stall_s)]
        if not frozen:
            # a running rank still in an ended generation is blocked in a collective with a peer that left it
            # (gloo ends it at the process group's timeout, not when that peer leaves): it gets that long
            silent = [entry for entry in silent if not self._blocked_in_ended_generation(entry[2], entry[1], now)]
            if not silent:
                return
        _, changed, hung = min(frozen or silent)
        local = next((rank for rank in self.ranks if rank.rank == hung and not rank.finished), None)
        if local is None or local.process is None or local.hung_for is not None:
            return
        local.hung_for = now - changed
        log.warning("rank %d (pid %d) sent no heartbeat for %.1f s (progress %d in generation %d): killing it",
                    hung, local.process.pid, local.hung_for, self._beats[hung].value[1], self.generation)
        local.process.kill()

    def _blocked_in_ended_generation(self, rank: int, changed: float, now: float) -> bool:
        """Whether ``rank`` runs (its alive key moves) but its heartbeat is of an older generation, for less than
        the process group's timeout (plus the hang timeout) so far; says so once per generation."""
        if self._beats[rank].value[0] >= self.generation:
            return False
        allowed = collective_timeout_s(settings().elastic_collective_timeout_s, self.spec.hang_timeout_s) + \
            self.spec.hang_timeout_s
        if now - changed > allowed:
            return False
        if (rank, self.generation) not in self._said_blocked:
            self._said_blocked.add((rank, self.generation))
            log.warning("rank %d runs but is still in generation %d (blocked in a collective of it, which gloo ends "
                        "at the process group's timeout): it gets %.0f s to leave before it is killed", rank,
                        self._beats[rank].value[0], allowed)
        return True

    def _frozen(self, rank: int, now: float, stall_s: float) -> bool:
        """Whether ``rank``'s process wrote its alive key once and then not for ``stall_s`` seconds."""
        seen = self._alive.get(rank)
        return seen is not None and seen[0] != keys.NOT_ALIVE_YET.encode() and now - seen[1] > stall_s

    # --- end ------------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Every local rank finished: say so, and (node rank 0, which hosts the store) wait for the others."""
        self.store.set(keys.node_done(self.spec.node_rank), "1")
        if self.spec.node_rank == 0:
            everyone = [keys.node_done(node) for node in range(self.spec.nnodes)]
            wait_for(lambda: self.store.check(everyone), what="every node's supervisor to finish",
                     timeout_s=self.spec.join_timeout_s, poll_s=0.1)

    def _stop_ranks(self) -> None:
        """Let the running ranks leave on their own (a stopping job: they see ``elastic/stop`` at their next
        step; ``_LEAVE_GRACE_S``), then SIGTERM, then SIGKILL ``_TERM_GRACE_S`` later."""
        running = [rank for rank in self.ranks if rank.process is not None and rank.process.poll() is None]
        stopping = self.store is not None and self._store_says_stop()
        grace = self._leave_grace_s() if stopping else _LEAVE_GRACE_S
        for signal_next in ((None,) if stopping else ()) + (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + (grace if signal_next is None else self.spec.term_grace_s)
            for rank in running:
                if signal_next is not None and rank.process.poll() is None:
                    rank.process.send_signal(signal_next)
            for rank in running:
                try:
                    rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if all(rank.process.poll() is not None for rank in running):
                break
        for rank in running:
            code = rank.process.wait()
            log.info("rank %d (pid %d) %s", rank.rank, rank.process.pid,
                     f"exited with code {code}" if code >= 0 else f"ended by {signal.Signals(-code).name}")

    def _say_stopped(self) -> None:
        """The job stopped and this node's ranks are gone: say so; node 0 (the store's host) waits a while
        for the other nodes to say it too, so that none loses the store while its ranks are leaving."""
        if self.store is None:
            return
        try:
            self.store.set(keys.node_stopped(self.spec.node_rank), "1")
            if self.spec.node_rank != 0:
                return
            values = self.store.multi_get([keys.node_beat(node) for node in range(1, self.spec.nnodes)])
            joined = [node for node, value in enumerate(values, 1) if not value.startswith(b"0:")
                      and node not in self._lost]
            wait_for(lambda: self.store.check([keys.node_stopped(node) for node in joined]),
                     what=f"nodes {joined} to stop their ranks",
                     timeout_s=self._leave_grace_s() + 2 * self.spec.term_grace_s + 5.0, poll_s=0.05)
        except Exception as error:  # noqa: BLE001 - the job is over either way
            log.warning("not every node said it stopped: %s", error)

    def _leave_grace_s(self) -> float:
        """Seconds the ranks of the stopping job get to leave on their own (the stop request says)."""
        try:
            return float(json.loads(self.store.get(keys.STOP)).get("grace_s", _LEAVE_GRACE_S))
        except Exception:  # noqa: BLE001 - no request, or the store is gone
            return _LEAVE_GRACE_S

    def _store_says_stop(self) -> bool:
        try:
            return bool(self.store.check([keys.STOP]))
        except Exception:  # noqa: BLE001 - the store is gone with node 0: no rank can see a stop
            return False
