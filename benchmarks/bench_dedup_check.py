"""Benchmark of self-healing dedup's cost (not part of the test run), against moto's S3 server on loopback.

Measures, for a step whose content-addressed chunks are all stored already (a frozen model):

1. the size-only check promotion used before (one LIST) against :func:`ckptd.promotion.dedup.chunks_to_upload`
   the first time (one HEAD per chunk, the local copy read and CRC32'd) and once remembered (two LISTs);
2. what the CRC32 asked of the store at upload costs: uploads of one object with ``s3_upload_checksum``
   CRC32 and off, interleaved rounds, best of each.

Usage: ``python benchmarks/bench_dedup_check.py [--chunks 64] [--chunk-mib 4] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ckptd.config import override  # noqa: E402
from ckptd.embedded_s3 import EmbeddedS3  # noqa: E402
from ckptd.promotion import dedup, promote_step  # noqa: E402
from ckptd.promotion.contents import read_step_contents  # noqa: E402
from ckptd.promotion.promoter import stored_chunks  # noqa: E402
from ckptd.tiers.object import ObjectTier  # noqa: E402
from test_promotion_support import save_local  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--upload-mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chunk = args.chunk_mib * 1024 * 1024
    results: dict[str, object] = {"chunks": args.chunks, "chunk_mib": args.chunk_mib}
    with EmbeddedS3() as server, tempfile.TemporaryDirectory() as scratch:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        state = {"frozen": torch.randn(args.chunks * chunk // 4, generator=torch.Generator().manual_seed(0))}
        local = save_local(Path(scratch) / "local", {1: state, 2: state}, chunk_bytes=chunk)
        remote = ObjectTier(f"s3://{bucket}/run", storage_options=server.storage_options)
        promote_step(local, remote, 1)
        needed = read_step_contents(local, 2).unique_chunks()
        sent: list[str] = []
        remote.on_request(lambda request, **_: sent.append(request.method))

        def timed(name: str, call) -> None:
            sent.clear()
            started = time.perf_counter()
            call()
            results[name] = {"seconds": round(time.perf_counter() - started, 4), "requests": len(sent),
                             "heads": sent.count("HEAD")}

        timed("size_only", lambda: stored_chunks(remote))
        dedup.forget_verified()
        timed("checksum_first", lambda: dedup.chunks_to_upload(remote, needed, local))
        results["checksum_first"]["local_mib_read"] = dedup.last_check.local_bytes_read / 2**20  # type: ignore
        timed("checksum_remembered", lambda: dedup.chunks_to_upload(remote, needed, local))
        data = os.urandom(args.upload_mib * 1024 * 1024)
        best = {"CRC32": float("inf"), "": float("inf")}
        for _ in range(3):
            for algorithm in best:
                with override(s3_upload_checksum=algorithm):
                    tier = ObjectTier(f"s3://{bucket}/run", storage_options=server.storage_options)
                    started = time.perf_counter()
                    tier.write_bytes(f"upload-{uuid.uuid4().hex[:6]}", data)
                    best[algorithm] = min(best[algorithm], time.perf_counter() - started)
                    tier.close()
        results["upload_mib_per_s"] = {"crc32": round(args.upload_mib / best["CRC32"], 1),
                                       "no_checksum": round(args.upload_mib / best[""], 1)}
        remote.close()
    print(json.dumps(results, indent=2) if args.json else results)


if __name__ == "__main__":
    main()
