"""Which job a promotion in a step directory belongs to, so that a restarted job owns its interrupted
promotions and two jobs on one prefix are still told apart.

Before a promoter writes the written-once objects of its share of a step (rank index, pack), it writes a
**claim**, ``claim-rank-NNNNN.json`` in the step directory, once (``If-None-Match``), naming:

- the **run id**: the job's identity, the same for every restart of the job on any node. It is the setting
  ``run_id`` (``CKPTD_RUN_ID``) when set, else the object-tier URL itself: by default the prefix is the job
  (the rule the refusal's hint has always given, one prefix per job), so a restart on a new node with an
  empty local directory knows its run id without anything local;
- the **incarnation**: one random id per promoter (per process start), with the host and the pid.

When a written-once object of the step already holds other bytes (another promotion of this step number
with other content), the claim decides (:func:`decide`):

- the same run id, from another incarnation that is not alive (on this host: its process is gone; on
  another host: the same run id says the job restarted, so its earlier incarnation is over) -> the
  promotion was **interrupted** by this job's own crash: its objects of the step are removed and the step is
  promoted again (:func:`take_over`);
- the same incarnation (a step set aside and saved again by this very process) -> replaced the same way;
- another run id, a live incarnation (a promotion in flight), or no claim at all (a promotion by an older
  ckptd) -> refused with a :class:`~ckptd.errors.CommitError`, as before.

A promotion that took over the step, or lost it to a taker, is never committed over the other one's files:
the committing promoter reads its claims back just before it writes the manifest. The
claim is deleted once the step is committed (it is bookkeeping, never data; a claim left by a crash between
the two is harmless and goes with the step).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass

from ckptd.config import settings
from ckptd.errors import CkptdError, CommitError, NotFoundError
from ckptd.format.layout import MANIFEST_NAME, rank_file_prefix, step_file
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import process_exists, process_start, this_host

#: What :func:`decide` answers.
MINE, INTERRUPTED, FOREIGN = "mine", "interrupted", "foreign"


def claim_name(rank: int) -> str:
    """Name of the claim of one rank's share of a step, in the step directory."""
    return f"claim-rank-{rank:05d}.json"


def run_id_for(remote: ObjectTier) -> str:
    """This job's run id on ``remote``: the ``run_id`` setting, else the object tier's URL (see the module
    docstring)."""
    return settings().run_id.strip() or remote.url.rstrip("/")


@dataclass(frozen=True)
class Claim:
    """Who promotes one rank's share of a step: the job (``run_id``) and the process (``incarnation``,
    ``host``, ``pid`` and ``started``, its :func:`~ckptd.tiers.upload_owners.process_start`)."""

    run_id: str
    incarnation: str
    host: str
    pid: int
    started: str = ""
    written: float = 0.0

    @classmethod
    def mine(cls, run_id: str) -> Claim:
        """A claim for this process (a fresh incarnation)."""
        return cls(run_id=run_id, incarnation=uuid.uuid4().hex, host=this_host(), pid=os.getpid(),
                   started=process_start(os.getpid()), written=time.time())

    def to_json_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> Claim | None:
        """The claim, or None when it is mangled (a mangled claim proves no ownership)."""
        try:
            body = json.loads(raw)
            return cls(run_id=str(body["run_id"]), incarnation=str(body["incarnation"]), host=str(body["host"]),
                       pid=int(body["pid"]), started=str(body.get("started") or ""),
                       written=float(body.get("written") or 0.0))
        except (ValueError, KeyError, TypeError):
            return None

    def alive(self) -> bool:
        """Whether this claim's process may still be promoting: on this host, while its process runs; on
        another host it cannot be told, so the run id decides (see :func:`decide`)."""
        return self.host == this_host() and process_exists(self.pid, self.started)

    def describe(self) -> str:
        return f"job {self.run_id!r}, process {self.pid} on {self.host}"


def read_claim(remote: ObjectTier, step: int, rank: int) -> Claim | None:
    """The claim of ``rank``'s share of ``step`` (None: none, or mangled)."""
    try:
        return Claim.from_json_bytes(remote.read_bytes(step_file(step, claim_name(rank))))
    except NotFoundError:
        return None


def read_claim_quietly(remote: ObjectTier, step: int, rank: int) -> Claim | None:
    """:func:`read_claim`, None too when the tier does not answer (for messages only)."""
    try:
        return read_claim(remote, step, rank)
    except CkptdError:
        return None


def decide(mine: Claim, stored: Claim | None) -> str:
    """Whether the other promotion of a step behind ``stored`` is this very promoter's (:data:`MINE`), an
    interrupted one of this job (:data:`INTERRUPTED`), or another job's or a live one (:data:`FOREIGN`)."""
    if stored is None or stored.run_id != mine.run_id:
        return FOREIGN
    if stored.incarnation == mine.incarnation:
        return MINE
    if stored.alive():
        return FOREIGN
    return INTERRUPTED


def take_over(remote: ObjectTier, step: int, ranks: list[int], claim: Claim, *, whole_step: bool) -> list[str]:
    """Remove what an interrupted promotion of this job left of ``step`` (every file but a manifest with
    ``whole_step``, else the files of ``ranks``) and claim the shares of ``ranks`` for ``claim``; returns the
    names removed."""
    names = remote.list_files(step)
    if MANIFEST_NAME in names:  # committed meanwhile by the other promotion: a committed step is never touched
        raise CommitError("the other promotion of this step committed it meanwhile: nothing of it is replaced",
                          step=step, tier=remote.label, path=step_file(step, MANIFEST_NAME),
                          hint="delete it there (ckptd gc) or promote into another prefix")
    if whole_step:
        doomed = [name for name in names if name != MANIFEST_NAME]
    else:
        prefixes = tuple(rank_file_prefix(rank) for rank in ranks) + tuple(claim_name(rank) for rank in ranks)
        doomed = [name for name in names if name.startswith(prefixes)]
    if doomed:
        remote.delete_files([step_file(step, name) for name in doomed])
    for rank in ranks:
        remote.write_bytes(step_file(step, claim_name(rank)), claim.to_json_bytes())
    return doomed


__all__ = ["Claim", "FOREIGN", "INTERRUPTED", "MINE", "claim_name", "decide", "read_claim", "read_claim_quietly",
           "run_id_for", "take_over"]
