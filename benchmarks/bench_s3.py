"""Benchmark of the object tier (not part of the test run), against moto's S3 server on loopback.

Measures, on the same bytes, the same server and in the same run (rounds interleave the cases, so a change
in machine load hits every case alike; the best round of each case counts):

1. promotion throughput with verification (every chunk re-hashed from the bytes sent, remote manifest
   last) against the better of s3fs's ``put`` and boto3's TransferManager uploading every data file of
   the step (the pack ``rank-00000.data`` and the parallel files ``.1.data``, ``.2.data``...: the same
   bytes ckptd sends), all files at once, with ckptd's part size and concurrency, and boto3 once more
   with one PUT per file (``_whole``: moto's multipart and ranged requests cost more than real S3's);
2. restore from S3 into memory (``CheckpointManager.restore`` with an empty local tier, every chunk
   verified, into target tensors written before the timer as a model's parameters are) against the
   better of s3fs's ``cat`` and boto3's TransferManager downloading the same data files into memory,
   all at once. Every client is connected before its timer; opening a manager on the S3 tier (its
   clients, their first connections) is timed on its own;
3. dedup: bytes uploaded at step 2 of a fine-tuning-like workload (large frozen part, small trained part)
   as a fraction of step 1;
4. objects and requests per step: a model of 200 small tensors and 4 large frozen ones, promoted at two
   steps and restored from the object tier, with packing (the default) and without
   (``CKPTD_PACK_BELOW_BYTES=0``): objects each step adds to the bucket, uploads per step, GETs per
   restore and the restore's seconds.

Throughput is bytes of the step's data files over seconds, for every case alike.

Usage: ``python benchmarks/bench_s3.py [--mib 256] [--repeats 2] [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import s3fs
import torch
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config

import ckptd
from ckptd.config import override, settings
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.errors import NotFoundError
from ckptd.format.layout import step_dir
from ckptd.promotion import promote_step
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

MIB = 1024 * 1024
_MAX_SINGLE_PUT = 5 * 1024 * MIB


class _Case:
    """One measured operation: ``prepare`` and ``clean`` run outside the timing."""

    def __init__(self, run: Callable[[Any], None], prepare: Callable[[], Any] = lambda: None,
                 clean: Callable[[Any], None] = lambda context: None) -> None:
        self.run, self.prepare, self.clean = run, prepare, clean


def _best_of(repeats: int, cases: dict[str, _Case]) -> dict[str, float]:
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            context = case.prepare()
            started = time.perf_counter()
            case.run(context)
            best[name] = min(best[name], time.perf_counter() - started)
            case.clean(context)
    return best


class _Bench:
    def __init__(self, server: EmbeddedS3, workdir: Path) -> None:
        self.server, self.workdir = server, workdir
        self.options = server.storage_options
        self.client = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1",
                                   config=Config(max_pool_connections=4 * settings().s3_concurrency))

    def bucket(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:10]}"
        self.server.create_bucket(name)
        return name

    def drop(self, bucket: str) -> None:
        """Empty and delete a bucket so the server's memory does not grow round after round."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        self.client.delete_bucket(Bucket=bucket)

    def transfer(self, mib: int, repeats: int) -> dict[str, Any]:
        state = {"weights": torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(1))}
        local_dir = self.workdir / "local"
        with ckptd.CheckpointManager(local_dir, capture_rng=False) as manager:
            manager.save(1, state)
        local = LocalTier(local_dir)
        data_files = _data_files(local, 1)
        size = sum(path.stat().st_size for path in data_files)
        plain_fs = s3fs.S3FileSystem(**self.options, skip_instance_cache=True)
        plain, whole = _PlainBoto3(self.client), _PlainBoto3(self.client, whole_objects=True)
        source_bucket = self.bucket()
        plain.upload(data_files, source_bucket)
        plain_keys = [f"plain/{path.name}" for path in data_files]
        restore_remote = ObjectTier(f"s3://{source_bucket}/ckpt", storage_options=self.options)
        promote_step(local, restore_remote, 1)

        def connect(tier: ObjectTier) -> ObjectTier:
            """Open ``tier``'s clients and connections, for data and for metadata (the plain clients are
            connected before their timer too)."""
            tier.connect()
            tier.exists("warm-up")
            for _ in tier.lanes:
                with contextlib.suppress(NotFoundError):
                    tier.read_bytes("warm-up")
            return tier

        def fresh_tier() -> ObjectTier:
            return connect(ObjectTier(f"s3://{self.bucket()}/ckpt", storage_options=self.options))

        opening: list[float] = []

        def open_reader() -> tuple[ckptd.CheckpointManager, dict[str, torch.Tensor]]:
            """A manager on an empty local tier and the S3 step, connected, and the (written) target
            tensors, as a model built before its restore has them; opening is timed on its own."""
            started = time.perf_counter()
            manager = ckptd.CheckpointManager(self.workdir / f"empty-{uuid.uuid4().hex[:6]}",
                                              remote=restore_remote.url, storage_options=self.options,
                                              capture_rng=False)
            connect(manager.remote)  # type: ignore[arg-type]
            opening.append(time.perf_counter() - started)
            return manager, {"weights": torch.zeros_like(state["weights"])}

        def restore(reader: tuple[ckptd.CheckpointManager, dict[str, torch.Tensor]]) -> None:
            manager, target = reader
            if manager.restore(target) != 1:
                raise RuntimeError("restore from S3 found no step")

        def close_reader(reader: tuple[ckptd.CheckpointManager, dict[str, torch.Tensor]]) -> None:
            manager, target = reader
            manager.close()
            shutil.rmtree(manager.local.root, ignore_errors=True)
            if not torch.equal(target["weights"], state["weights"]):
                raise RuntimeError("restore from S3 returned other bytes")

        def s3fs_put(bucket: str) -> None:
            plain_fs.put([str(path) for path in data_files], [f"{bucket}/plain/{path.name}" for path in data_files])

        def s3fs_cat(_: None) -> None:
            got = plain_fs.cat([f"{source_bucket}/{key}" for key in plain_keys])
            if sum(len(data) for data in got.values()) != size:
                raise RuntimeError("s3fs.cat returned other sizes")

        def boto3_download(client: _PlainBoto3) -> None:
            if sum(len(data) for data in client.download(source_bucket, plain_keys)) != size:
                raise RuntimeError("boto3 download returned other sizes")

        upload_cases = {
            "promote_verified": _Case(lambda tier: promote_step(local, tier, 1), fresh_tier,
                                      lambda tier: self.drop(tier.bucket)),
            "s3fs.put": _Case(s3fs_put, self.bucket, self.drop),
            "boto3.upload": _Case(lambda bucket: plain.upload(data_files, bucket), self.bucket, self.drop),
            "boto3.upload_whole": _Case(lambda bucket: whole.upload(data_files, bucket), self.bucket, self.drop),
        }
        download_cases = {
            "restore_verified": _Case(restore, open_reader, close_reader),
            "s3fs.cat": _Case(s3fs_cat),
            "boto3.download": _Case(boto3_download, lambda: plain),
            "boto3.download_whole": _Case(boto3_download, lambda: whole),
        }
        upload = _best_of(repeats, upload_cases)
        download = _best_of(repeats, download_cases)
        plain.close()
        whole.close()
        restore_remote.close()
        self.drop(source_bucket)
        gbps = {name: size / seconds / 1e9 for name, seconds in {**upload, **download}.items()}
        best_put = max(value for name, value in gbps.items() if name.startswith(("s3fs.put", "boto3.upload")))
        best_get = max(value for name, value in gbps.items() if name.startswith(("s3fs.cat", "boto3.download")))
        return {"bytes": size, "data_files": len(data_files), "GB_per_s": {k: round(v, 4) for k, v in gbps.items()},
                "open_manager_s": round(min(opening), 3),
                "promotion_vs_best_plain_upload": round(gbps["promote_verified"] / best_put, 3),
                "restore_vs_best_plain_download": round(gbps["restore_verified"] / best_get, 3)}

    def objects_per_step(self, small_tensors: int = 200, large_tensors: int = 4) -> dict[str, Any]:
        frozen = {f"frozen.{i}": torch.randn(512 * 1024, generator=torch.Generator().manual_seed(i))
                  for i in range(large_tensors)}

        def state(step: int) -> dict[str, torch.Tensor]:
            trained = torch.Generator().manual_seed(100 + step)
            return {**frozen, **{f"layer.{i}": torch.randn(256, generator=trained) for i in range(small_tensors)}}

        results: dict[str, Any] = {}
        for label, pack_below in (("packed", None), ("unpacked", 0)):
            bucket, local_dir = self.bucket(), self.workdir / f"objects-{label}"
            extra = {} if pack_below is None else {"pack_below_bytes": pack_below}
            with override(**extra), ckptd.CheckpointManager(local_dir, capture_rng=False) as manager:
                for step in (1, 2):
                    manager.save(step, state(step))
            remote = ObjectTier(f"s3://{bucket}/run", storage_options=self.options)
            requests = _record_requests(remote)
            seen: set[str] = set()
            per_step = {}
            for step in (1, 2):
                requests.clear()
                promote_step(LocalTier(local_dir), remote, step)
                keys = {obj.path for obj in remote.list_objects("")}
                per_step[step] = {"new_objects": len(keys - seen),
                                  "uploads": sum(1 for m in requests if m in ("put_object", "upload_part"))}
                seen |= keys
            requests.clear()
            target = {name: torch.zeros_like(tensor) for name, tensor in state(2).items()}
            started = time.perf_counter()
            reader_dir = self.workdir / f"restore-{label}"
            with ckptd.CheckpointManager(reader_dir, remote=remote.url, storage_options=self.options,
                                         capture_rng=False) as manager:
                restore_requests = _record_requests(manager.remote)  # type: ignore[arg-type]
                if manager.restore(target) != 2 or not all(torch.equal(target[k], v) for k, v in state(2).items()):
                    raise RuntimeError("restore from S3 returned other bytes")
                seconds = time.perf_counter() - started
            results[label] = {"steps": per_step, "restore_gets": restore_requests.count("get_object"),
                              "restore_s": round(seconds, 3)}
            remote.close()
            self.drop(bucket)
        return results

    def dedup(self, frozen_mib: int, trained_mib: int) -> dict[str, Any]:
        bucket = self.bucket()
        frozen = torch.randn(frozen_mib * MIB // 4, generator=torch.Generator().manual_seed(2))
        with override(chunk_bytes=4 * MIB):
            with ckptd.CheckpointManager(self.workdir / "dedup", remote=f"s3://{bucket}/ft",
                                         storage_options=self.options, capture_rng=False) as manager:
                for step in (1, 2):
                    trained = torch.randn(trained_mib * MIB // 4, generator=torch.Generator().manual_seed(10 + step))
                    manager.save(step, {"frozen": frozen, "trained": trained})
                manager.wait_uploads()
                uploaded = {report.step: report.bytes_uploaded for report in manager.upload_reports}
        self.drop(bucket)
        return {"bytes_uploaded": uploaded, "step2_over_step1": round(uploaded[2] / uploaded[1], 4)}


def _data_files(local: LocalTier, step: int) -> list[Path]:
    """Every data file of ``step`` on ``local`` (rank 0's pack and its parallel files): the bytes a
    promotion moves, apart from the small index and manifest."""
    manifest = load_step_manifest(local, step)
    names = [data_file.name for entry in manifest.ranks
             for data_file in load_rank_index(local, manifest, entry.rank).data_files]
    return [local.root / step_dir(step) / name for name in names]


class _PlainBoto3:
    """boto3's managed transfers as a user would set them up: one TransferManager for all files, with
    ckptd's part size and concurrency, so every file and every part of a file is in flight at once.

    With ``whole_objects`` every file is one PUT and one GET (no multipart, no ranges). moto reads an
    object whole for every ranged GET and copies the parts when it completes a multipart upload, costs
    that real S3 does not have; the single requests spare boto3 those, so its better variant counts."""

    def __init__(self, client: Any, *, whole_objects: bool = False) -> None:
        tuning = settings()
        threshold = _MAX_SINGLE_PUT if whole_objects else tuning.s3_part_bytes
        config = TransferConfig(multipart_threshold=threshold, multipart_chunksize=tuning.s3_part_bytes,
                                max_concurrency=tuning.s3_concurrency, use_threads=True)
        self.manager = create_transfer_manager(client, config)

    def upload(self, paths: list[Path], bucket: str) -> None:
        futures = [self.manager.upload(str(path), bucket, f"plain/{path.name}") for path in paths]
        for future in futures:
            future.result()

    def download(self, bucket: str, keys: list[str]) -> list[bytes]:
        """The objects' bytes, downloaded into memory."""
        buffers = [io.BytesIO() for _ in keys]
        futures = [self.manager.download(bucket, key, buffer) for key, buffer in zip(keys, buffers)]
        for future in futures:
            future.result()
        return [buffer.getvalue() for buffer in buffers]

    def close(self) -> None:
        self.manager.shutdown()


def _record_requests(tier: ObjectTier) -> list[str]:
    """The S3 method (``put_object``, ``get_object``...) of every call ``tier`` makes from now on."""
    sent: list[str] = []
    tier.on_call(lambda operation, params: sent.append(operation))
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size for the transfer cases")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per case (best counts)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, one round")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    arguments = parser.parse_args()
    logging.getLogger("ckptd").setLevel(logging.ERROR)  # "step not on the local tier" is expected here
    mib, repeats = (64, 1) if arguments.quick else (arguments.mib, arguments.repeats)
    workdir = Path(tempfile.mkdtemp(prefix="ckptd-bench-s3-"))
    try:
        with EmbeddedS3() as server:
            bench = _Bench(server, workdir)
            results = {"transfer": bench.transfer(mib, repeats), "dedup": bench.dedup(frozen_mib=64, trained_mib=1),
                       "objects_per_step": bench.objects_per_step()}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if arguments.json:
        print(json.dumps(results, indent=2))
        return
    transfer = results["transfer"]
    print(f"object tier on moto (loopback), {transfer['bytes'] / MIB:.0f} MiB in {transfer['data_files']} data files, "
          f"best of {repeats}:")
    for name, value in transfer["GB_per_s"].items():
        print(f"  {name:<22} {value:.3f} GB/s")
    print(f"  promotion (verified) / best plain upload:   {transfer['promotion_vs_best_plain_upload']:.2f} x")
    print(f"  restore (verified) / best plain download:   {transfer['restore_vs_best_plain_download']:.2f} x")
    print(f"  opening a manager on the S3 tier, connected (not in the restore's time): "
          f"{transfer['open_manager_s']:.2f} s")
    dedup = results["dedup"]
    print(f"dedup: bytes uploaded {dedup['bytes_uploaded']}, step 2 / step 1 = {dedup['step2_over_step1']:.2%}")
    print("objects and requests per step (200 small tensors, 4 large frozen ones, one rank):")
    for label, row in results["objects_per_step"].items():
        steps = ", ".join(f"step {step}: {v['new_objects']} new objects, {v['uploads']} uploads"
                          for step, v in row["steps"].items())
        print(f"  {label:<9} {steps}; restore: {row['restore_gets']} GETs, {row['restore_s']:.2f} s")


if __name__ == "__main__":
    main()
