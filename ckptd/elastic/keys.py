"""The names a supervisor and its workers share: environment variables and keys of the job's store.

Keys under ``elastic/`` belong to the supervisors and live for the whole job. Everything a rank of
generation ``g`` writes goes under ``gen{g}/`` (:func:`generation_prefix`): its process group, its
checkpoint manager's commit rounds, its barriers. A process of an older generation therefore never
reads or writes a key of the current one.
"""

from __future__ import annotations

#: Generation the worker was started in (0 at launch, one more at each recovery).
ENV_GENERATION = "CKPTD_GENERATION"
#: ``host:port`` of the job's c10d TCPStore (hosted by the node-rank-0 supervisor).
ENV_STORE = "CKPTD_ELASTIC_STORE"
#: How often the supervisor started this rank before (0 for the first process of the rank).
ENV_RESTART_COUNT = "CKPTD_ELASTIC_RESTART_COUNT"
#: Set (to the spare's number on its node) in a warm spare: it has no rank until its supervisor gives one.
ENV_SPARE = "CKPTD_ELASTIC_SPARE"
#: The supervisor's ``--hang-timeout`` in seconds (0: none): a survivor waits that long, and more, for the
#: generation that replaces a hung peer.
ENV_HANG_TIMEOUT = "CKPTD_ELASTIC_HANG_TIMEOUT_S"

#: Set to "1" when the supervisor was started with ``--checkpoint-on-stop`` (see :mod:`ckptd.elastic.stop_checkpoint`).
ENV_CHECKPOINT_ON_STOP = "CKPTD_ELASTIC_CHECKPOINT_ON_STOP"

#: The current generation, a decimal string; raised by the supervisor that sees a rank fail.
GENERATION = "elastic/generation"
#: Set (JSON: exit code, rank, cause) when the job stops: every supervisor stops its ranks.
STOP = "elastic/stop"
#: (Under the generation prefix.) The step every rank saves before it leaves a job stopping with a checkpoint.
STOP_STEP = "elastic/stop-step"
#: Restarts spent by the whole job (a store counter).
RESTARTS = "elastic/restarts"
#: Set by the node-rank-0 supervisor once the job's keys exist.
OPEN = "elastic/open"
#: Supervisors that joined (a store counter).
NODES = "elastic/nodes"
#: Failures in a row with no step completed in between (reset by a failure after a completed step).
CRASH_LOOP = "elastic/crash-loop"
#: The newest generation a counted failure happened in: a failure of a process of that generation or an older
#: one is part of an event already counted (ranks dying together, found in several rounds or by several nodes).
CRASH_LOOP_CHARGED = "elastic/crash-loop-charged"

#: Exit code of every supervisor and rank of a job stopped on request (SIGTERM or SIGINT to a supervisor).
EXIT_STOPPED = 15


def beat(rank: int) -> str:
    """A rank's heartbeat: ``"<generation>:<progress>:<sequence>:<step>"``, rewritten at every beat. Progress
    counts the training's beats (0: not started in this generation, -1: its training function returned),
    sequence every write, those of a rank waiting for its peers included; step is the newest step the rank
    completed in this generation (a save names it; -1: none yet). Only progress above 0 arms the hang
    timeout."""
    return f"elastic/beat/{rank}"


def alive(rank: int) -> str:
    """A rank's process is scheduled: ``"<pid>:<count>"``, rewritten every ``ALIVE_EVERY_S`` by a thread of the rank
    (its generation watcher) whatever its training thread does. A rank whose training heartbeat stalled while
    this one goes on waits (in a collective with a stalled peer, say); one whose both stalled is frozen
    (stopped, or stuck where no thread of it runs): the supervisor blames the frozen one."""
    return f"elastic/alive/{rank}"


#: Seconds between two writes of a rank's :func:`alive` key.
ALIVE_EVERY_S = 0.1
#: The value of :func:`alive` before the rank's first write.
NOT_ALIVE_YET = "0:0"


def node_done(node_rank: int) -> str:
    """Set by a supervisor once all its ranks finished."""
    return f"elastic/node-done/{node_rank}"


def node_stopped(node_rank: int) -> str:
    """Set by a supervisor once the job stopped and its ranks are gone (node 0 waits for it before exiting)."""
    return f"elastic/node-stopped/{node_rank}"


def node_beat(node_rank: int) -> str:
    """A supervisor's heartbeat: ``"<incarnation>:<sequence>"``, rewritten every few polls (``"0:0"``: no
    supervisor of that node joined yet). The other supervisors take a node whose heartbeat stops for
    ``--node-timeout`` seconds before it finished for lost."""
    return f"elastic/node-beat/{node_rank}"


def node_incarnation(node_rank: int) -> str:
    """Supervisors that joined the job with this node rank (a store counter): a second one replaces a lost
    node, and a supervisor that sees a higher count than its own was replaced and stops."""
    return f"elastic/node-incarnation/{node_rank}"


def rank_restarts(rank: int) -> str:
    """Restarts the rank spent (a store counter), kept across replacements of its node's supervisor."""
    return f"elastic/rank-restarts/{rank}"


def spare_ready(node_rank: int, spare: int) -> str:
    """Set (to its pid) by a warm spare once its setup is done and it waits for a rank."""
    return f"elastic/spare/{node_rank}/{spare}/ready"


def spare_assignment(node_rank: int, spare: int) -> str:
    """Set by the spare's supervisor (JSON: the rank's environment variables) to give it a rank."""
    return f"elastic/spare/{node_rank}/{spare}/assign"


def generation_prefix(generation: int) -> str:
    """The prefix of every key a rank of ``generation`` uses (``PrefixStore`` adds the ``/``)."""
    return f"gen{generation}"


def in_generation(generation: int, key: str) -> str:
    """The full name of ``key`` of ``generation`` (as ``PrefixStore(generation_prefix(g), store)`` names it)."""
    return f"{generation_prefix(generation)}/{key}"


def ready(rank: int) -> str:
    """(Under the generation prefix.) The rank joined the generation and is about to form the group."""
    return f"elastic/ready/{rank}"


def done(rank: int) -> str:
    """(Under the generation prefix.) The rank's training function returned and its managers closed."""
    return f"elastic/done/{rank}"


#: The heartbeat of a rank that has not beaten yet.
NO_BEAT = "-1:0:0:-1"


def parse_beat(value: bytes | str) -> tuple[int, int, int, int]:
    """(generation, progress, sequence, step) of a heartbeat value."""
    text = value.decode() if isinstance(value, bytes) else value
    generation, progress, sequence, step = text.split(":")
    return int(generation), int(progress), int(sequence), int(step)
