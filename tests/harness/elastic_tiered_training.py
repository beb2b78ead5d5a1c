"""The ``ckptd launch`` test job (:mod:`harness.elastic_training`) with a peer and an object tier:
``ckptd launch ... -m harness.elastic_tiered_training --remote s3://b/run --peer URL [job options]``.

Every rank's checkpoint manager gets ``--remote`` as its object tier (promoted in-process: every saved
step, or the multiples of ``--remote-every``) and ``--peer`` as its peer tier, with ``{node}`` and
``{rank}`` in both URLs replaced by the rank's node and rank (so that each rank's local directory can
have its own replica namespace on the buddy; the object prefix is usually one the job shares, where rank 0
commits each step once every rank's share is there). The peer token
comes from ``CKPTD_PEER_TOKEN``, the S3 credentials from the usual ``AWS_*`` variables; ``--endpoint-url``
names the S3 endpoint. Everything else (training, kills, records) is the plain job's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ckptd import elastic
from ckptd.manager.manager import CheckpointManager
from harness import elastic_training


class _TieredContext:
    """A worker context whose checkpoint managers also get the job's peer and object tiers."""

    def __init__(self, context: elastic.WorkerContext, tiers: argparse.Namespace) -> None:
        self._context, self._tiers = context, tiers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def checkpoint_manager(self, local: str | Path, **options: Any) -> CheckpointManager:
        ctx, tiers = self._context, self._tiers
        storage = {"client_kwargs": {"endpoint_url": tiers.endpoint_url}} if tiers.endpoint_url else {}
        peer = tiers.peer.format(node=ctx.node_rank, rank=ctx.rank) if tiers.peer else None
        if tiers.remote_every and "policy" in options:
            options["policy"] = dataclasses.replace(options["policy"], remote_every_steps=tiers.remote_every)
        remote = tiers.remote.format(node=ctx.node_rank, rank=ctx.rank) if tiers.remote else None
        return ctx.checkpoint_manager(local, remote=remote, peer=peer, storage_options=storage or None,
                                      daemon="off", **options)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, add_help=False)
    parser.add_argument("--remote", default=None, help="object tier URL; {node} and {rank} are replaced")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--peer", default=None, help="peer tier URL; {node} and {rank} are replaced")
    parser.add_argument("--remote-every", type=int, default=None, help="promote only steps that are multiples")
    tiers, rest = parser.parse_known_args(argv)
    plain_train = elastic_training._train

    def train(ctx: elastic.WorkerContext, args: argparse.Namespace) -> None:
        plain_train(_TieredContext(ctx, tiers), args)  # type: ignore[arg-type]

    # the plain job's main looks its training function up by name when elastic.run calls it
    elastic_training._train = train  # type: ignore[assignment]
    elastic_training.main(rest)


if __name__ == "__main__":
    main()
