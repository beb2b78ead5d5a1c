"""Benchmark of the verified shard loader (not part of the test run).

Measures, on the same data in the same run:

1. warm cache: the verified loader against the same loader with ``verify=False`` and against plain
   sequential file reads of the shards (samples/s and MB/s; goal: verified >= 0.95 x unverified);
2. cold cache: an epoch read from moto's S3 server on loopback through the loader (fetch, verify,
   cache) against a plain sequential s3fs read of the same objects;
3. mosaicml-streaming on the same data, if it is importable (it is not a ckptd dependency);
4. batch types: token batches as int64 tensors (the default collate) against lists of numpy arrays that
   the training loop stacks into a tensor itself (the loader's earlier output), with 0 and 2 workers
   (goal: tensors not slower).

Usage: ``python benchmarks/bench_data.py [--quick] [--json] [--no-s3] [--only-batches]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptd.data import DatasetManifest, ShardDataset, ShardLoader, index_dataset, list_batch
from ckptd.data.testing import write_jsonl_shards

MB = 1024 * 1024


@dataclass
class _Timing:
    """Best wall time and best CPU time (all threads of this process) of one case."""

    wall_s: float = float("inf")
    cpu_s: float = float("inf")
    samples: int = 0


def _best_of(repeats: int, cases: dict[str, Callable[[], int]]) -> dict[str, _Timing]:
    """Fastest wall and CPU time of each case over ``repeats`` rounds. Rounds run the cases one after
    another, so a change in machine load hits every case alike, in reversed order every other round
    (the first case of a round measured 5-10% slower on the development VM)."""
    best = {name: _Timing() for name in cases}
    for round_number in range(repeats):
        ordered = list(cases.items())
        for name, run in ordered if round_number % 2 == 0 else reversed(ordered):
            wall, cpu = time.perf_counter(), time.process_time()
            count = run()
            timing = best[name]
            timing.wall_s = min(timing.wall_s, time.perf_counter() - wall)
            timing.cpu_s = min(timing.cpu_s, time.process_time() - cpu)
            timing.samples = count
    return best


def _loader_epoch(manifest: DatasetManifest, cache: Path, verify: bool, batch: int,
                  storage_options: dict[str, Any] | None = None) -> int:
    dataset = ShardDataset(manifest, global_batch_size=batch, seed=0, cache_dir=cache, verify=verify,
                           storage_options=storage_options, cache_bytes=1 << 40)
    return sum(len(b) for b in ShardLoader(dataset))  # tensors and lists both count their samples


def _plain_tokens(directory: Path, seq_len: int) -> int:
    count = 0
    for path in sorted(directory.glob("*.bin")):
        tokens = np.frombuffer(path.read_bytes(), dtype=np.uint16)
        for start in range(0, len(tokens) - seq_len + 1, seq_len):
            tokens[start:start + seq_len].copy()
            count += 1
    return count


def _plain_jsonl(directory: Path) -> int:
    count = 0
    for path in sorted(directory.glob("*.jsonl")):
        with open(path, "rb") as handle:
            for line in handle:
                json.loads(line)
                count += 1
    return count


def _row(name: str, timing: _Timing, total_bytes: int) -> dict[str, Any]:
    return {"case": name, "seconds": round(timing.wall_s, 4), "cpu_seconds": round(timing.cpu_s, 4),
            "samples_per_s": round(timing.samples / timing.wall_s),
            "mb_per_s": round(total_bytes / MB / timing.wall_s, 1)}


def _ratio(baseline: _Timing, measured: _Timing) -> float:
    """Throughput of ``measured`` as a fraction of ``baseline``'s (wall time)."""
    return round(baseline.wall_s / measured.wall_s, 3)


def _token_shards(token_dir: Path, quick: bool, seed: int) -> tuple[Path, int]:
    """Writes random uint16 token shards into ``token_dir``; returns it and the ``seq_len`` to read them."""
    shards, tokens_per_shard, seq_len = (8, 2 * MB, 512) if quick else (16, 4 * MB, 1024)
    token_dir.mkdir()
    rng = np.random.default_rng(seed)
    for shard in range(shards):
        rng.integers(0, 50_000, tokens_per_shard, dtype=np.uint16).tofile(token_dir / f"part-{shard:03d}.bin")
    return token_dir, seq_len


def _warm_cases(root: Path, quick: bool, repeats: int) -> list[dict[str, Any]]:
    rows = []
    token_dir, seq_len = _token_shards(root / "tokens", quick, seed=0)
    jsonl_dir = root / "jsonl"
    write_jsonl_shards(jsonl_dir, [2_000 if quick else 5_000] * 8, payload_bytes=400)
    for name, directory, fmt, options, plain in (
            ("tokens", token_dir, "tokens", {"seq_len": seq_len}, lambda: _plain_tokens(token_dir, seq_len)),
            ("jsonl", jsonl_dir, "jsonl", {}, lambda: _plain_jsonl(jsonl_dir))):
        manifest = index_dataset(str(directory), fmt, reader_options=options).manifest
        cache = root / f"cache-{name}"
        _loader_epoch(manifest, cache, True, 64)  # fill the cache
        size = manifest.total_bytes
        timed = _best_of(repeats, {
            "verified": lambda: _loader_epoch(manifest, cache, True, 64),
            "unverified": lambda: _loader_epoch(manifest, cache, False, 64),
            "plain": plain})
        verified, unverified, sequential = timed["verified"], timed["unverified"], timed["plain"]
        rows += [_row(f"{name}: verified loader (warm cache)", verified, size),
                 _row(f"{name}: unverified loader (warm cache)", unverified, size),
                 _row(f"{name}: plain sequential file reads", sequential, size)]
        rows[-3]["ratio_vs_unverified"] = _ratio(unverified, verified)
        rows[-3]["cpu_ratio_vs_unverified"] = round(unverified.cpu_s / verified.cpu_s, 3)
        rows[-3]["ratio_vs_plain"] = _ratio(sequential, verified)
    return rows


def _cold_cases(root: Path, quick: bool, repeats: int) -> list[dict[str, Any]]:
    import fsspec

    from ckptd.embedded_s3 import EmbeddedS3

    rows = []
    shards, tokens_per_shard, seq_len = (4, 2 * MB, 512) if quick else (8, 4 * MB, 1024)
    with EmbeddedS3() as server:
        server.create_bucket("bench")
        options = server.storage_options
        fs = fsspec.filesystem("s3", **options)
        rng = np.random.default_rng(1)
        for shard in range(shards):
            fs.pipe_file(f"bench/tokens/part-{shard:03d}.bin",
                         rng.integers(0, 50_000, tokens_per_shard, dtype=np.uint16).tobytes())
        manifest = index_dataset("s3://bench/tokens", "tokens", reader_options={"seq_len": seq_len},
                                 storage_options=options).manifest
        counter = iter(range(1_000_000))

        def cold_loader() -> int:
            cache = root / f"cold-{next(counter)}"
            try:
                return _loader_epoch(manifest, cache, True, 64, storage_options=options)
            finally:
                shutil.rmtree(cache, ignore_errors=True)

        def plain_s3fs(cut: bool) -> int:
            total = 0
            for record in manifest.shards:
                tokens = np.frombuffer(fs.cat_file(f"bench/tokens/{record.path}"), dtype=np.uint16)
                for start in range(0, len(tokens) - seq_len + 1, seq_len):
                    if cut:
                        tokens[start:start + seq_len].copy()
                    total += 1
            return total

        timed = _best_of(repeats, {"loader": cold_loader, "plain": lambda: plain_s3fs(False),
                                   "plain_cut": lambda: plain_s3fs(True)})
        loader, plain, plain_cut = timed["loader"], timed["plain"], timed["plain_cut"]
        rows += [_row("s3 (moto): verified loader, cold cache", loader, manifest.total_bytes),
                 _row("s3 (moto): plain sequential s3fs reads", plain, manifest.total_bytes),
                 _row("s3 (moto): plain s3fs reads + cutting sequences", plain_cut, manifest.total_bytes)]
        rows[-3]["ratio_vs_plain"] = _ratio(plain, loader)
        rows[-3]["ratio_vs_plain_cut"] = _ratio(plain_cut, loader)
    return rows


def _training_tensors(manifest: DatasetManifest, cache: Path, batch: int, workers: int, as_list: bool) -> int:
    """One epoch ending in the int64 ``[batch, seq_len]`` tensor a model takes, either straight from the
    loader or stacked by the training loop from a list of numpy arrays."""
    dataset = ShardDataset(manifest, global_batch_size=batch, seed=0, cache_dir=cache, cache_bytes=1 << 40,
                           collate_fn=list_batch if as_list else None)
    count = 0
    for item in ShardLoader(dataset, num_workers=workers):
        tokens = torch.from_numpy(np.stack(item).astype(np.int64)) if as_list else item
        count += int(tokens.shape[0])
    return count


def _batch_type_cases(root: Path, quick: bool, repeats: int) -> list[dict[str, Any]]:
    rows = []
    token_dir, seq_len = _token_shards(root / "batch-tokens", quick, seed=2)
    manifest = index_dataset(str(token_dir), "tokens", reader_options={"seq_len": seq_len}).manifest
    cache = root / "cache-batch-tokens"
    _training_tensors(manifest, cache, 64, 0, False)  # fill the cache
    for workers in (0, 2):
        timed = _best_of(repeats, {
            "tensors": lambda: _training_tensors(manifest, cache, 64, workers, False),
            "lists": lambda: _training_tensors(manifest, cache, 64, workers, True)})
        tensors, lists = timed["tensors"], timed["lists"]
        rows += [_row(f"tokens, {workers} workers: int64 tensor batches", tensors, manifest.total_bytes),
                 _row(f"tokens, {workers} workers: numpy lists stacked by the loop", lists, manifest.total_bytes)]
        rows[-2]["ratio_vs_lists"] = _ratio(lists, tensors)
    return rows


def _streaming_case() -> list[dict[str, Any]]:
    try:
        import streaming  # noqa: F401
    except ImportError:
        return [{"case": "mosaicml-streaming", "skipped": "not installed (it would replace the venv's torch)"}]
    return [{"case": "mosaicml-streaming", "skipped": "comparison not implemented for this version"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, one repeat")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto cold-cache case")
    parser.add_argument("--only-batches", action="store_true", help="run only the batch-type comparison")
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    root = Path(tempfile.mkdtemp(prefix="ckptd-bench-data-"))
    try:
        rows = [] if args.only_batches else _warm_cases(root, args.quick, repeats)
        if not args.no_s3 and not args.only_batches:
            rows += _cold_cases(root, args.quick, repeats)
        rows += _batch_type_cases(root, args.quick, repeats)
        if not args.only_batches:
            rows += _streaming_case()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        if "skipped" in row:
            print(f"{row['case']:<48} skipped: {row['skipped']}")
            continue
        ratios = "  ".join(f"{k}={v}" for k, v in row.items() if "ratio" in k)
        print(f"{row['case']:<48} {row['samples_per_s']:>9} samples/s {row['mb_per_s']:>7} MB/s "
              f"{row['cpu_seconds']:>7} cpu-s  {ratios}")


if __name__ == "__main__":
    main()
