"""Benchmark of the peer tier (not part of the test run): replication to a buddy's peer endpoints, and restore
from the peer tier against restore from the object tier (moto's S3 server) and from the local tier.

The buddy is a real peer server (:class:`harness.peer_server.PeerServer`, the daemon's routes) in a
child process, on loopback; the object tier is moto's server in another child process. The same committed
step (``--mib`` MiB of float32 tensors in 16 MiB chunks, plus a few small ones in the pack) is replicated to
the peer and promoted to S3, then restored ``--repeats`` times from each tier, rounds interleaved so that a
change in machine load hits every case alike; the best round of each case counts. Every restore verifies
every chunk and is compared with the saved tensors once.

Usage: ``python benchmarks/bench_peer.py [--mib 256] [--repeats 3] [--json]``.
"""

from __future__ import annotations

import harness_path  # noqa: F401  (tests/harness)

import argparse
import json
import multiprocessing
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import ckptd
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.manager.restoring import restore_state
from ckptd.promotion import promote_step
from ckptd.promotion.replicate import replicate_step
from ckptd.tiers import open_tier
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier

MIB = 1024 * 1024
TOKEN = "bench-peer-token"


def _serve(replicas: str, ports: Any) -> None:
    from ckptd.daemon.peer_store import PeerNamespaces
    from harness.peer_server import PeerServer

    server = PeerServer(PeerNamespaces({}, Path(replicas)), token=TOKEN)
    ports.put(server.start())
    time.sleep(24 * 3600)


def _state(mib: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state = {f"layer{index}": torch.randn(16 * MIB // 4, generator=generator) for index in range(mib // 16)}
    state.update({f"small{index}": torch.randn(1000, generator=generator) for index in range(20)})
    return state


def _restore_seconds(tier: StorageTier, state: dict[str, torch.Tensor], check: bool) -> float:
    target = {name: torch.empty_like(value) for name, value in state.items()}
    for value in target.values():
        value.zero_()  # written before the timer, as a model's parameters are
    started = time.perf_counter()
    result = restore_state([tier], target, rank=0, world_size=1)
    seconds = time.perf_counter() - started
    if result.step != 1 or (check and not all(torch.equal(target[name], state[name]) for name in state)):
        raise SystemExit(f"restore from {tier.label} returned other bytes")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-peer-"))
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    buddy = context.Process(target=_serve, args=(str(work / "replicas"), ports), daemon=True)
    buddy.start()
    try:
        state = _state(options.mib)
        with ckptd.CheckpointManager(work / "local", capture_rng=False, policy=ckptd.Policy(keep_local=None)) as manager:
            manager.save(1, state)
            manager.wait()
        local = LocalTier(work / "local")
        data_bytes = sum(path.stat().st_size for path in (work / "local" / "step-000000000001").glob("*.data"))
        peer = PeerTier(f"peer://127.0.0.1:{ports.get(timeout=60)}/replicas/node-a/run1", token=TOKEN)
        started = time.perf_counter()
        replicated = replicate_step(local, peer, 1)
        replicate_s = time.perf_counter() - started
        with EmbeddedS3() as s3:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(bucket)
            remote = open_tier(f"s3://{bucket}/run", storage_options=s3.storage_options)
            started = time.perf_counter()
            promote_step(local, remote, 1)  # type: ignore[arg-type]
            promote_s = time.perf_counter() - started
            cases: dict[str, StorageTier] = {"local": local, "peer": peer, "object": remote}
            rounds: dict[str, list[float]] = {name: [] for name in cases}
            for repeat in range(options.repeats):
                for name, tier in cases.items():
                    rounds[name].append(_restore_seconds(tier, state, check=repeat == 0))
            remote.close()
        peer.close()
        best = {name: min(seconds) for name, seconds in rounds.items()}
        results = {
            "data_mib": data_bytes / MIB,
            "replicate_mib_per_s": data_bytes / MIB / replicate_s, "replicated_bytes": replicated.bytes_sent,
            "promote_mib_per_s": data_bytes / MIB / promote_s,
            **{f"restore_{name}_mib_per_s": data_bytes / MIB / seconds for name, seconds in best.items()},
            "restore_peer_vs_object": best["object"] / best["peer"],
        }
        if options.json:
            print(json.dumps(results, indent=1))
        else:
            print(f"step of {results['data_mib']:.0f} MiB of data files")
            print(f"replicate to the peer tier: {results['replicate_mib_per_s']:.0f} MiB/s; "
                  f"promote to S3 (moto): {results['promote_mib_per_s']:.0f} MiB/s")
            for name in cases:
                print(f"restore from {name:6s}: {results[f'restore_{name}_mib_per_s']:.0f} MiB/s (best of "
                      f"{options.repeats})")
            print(f"restore from the peer tier is {results['restore_peer_vs_object']:.1f}x the object tier")
    finally:
        buddy.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
