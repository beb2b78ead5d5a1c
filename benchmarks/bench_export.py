"""Export throughput: ``ckptd export --consolidate`` against DCP's Hugging Face consolidation (not a test).

One state, sharded over 2 real gloo ranks as DTensors (``Shard(0)``; ``--size`` of fp32 in tensors of
``--tensor-size``), is saved twice: by a CheckpointManager (ckptd's format) and by ``dcp.save`` with
``HuggingFaceStorageWriter(save_distributed=True)`` (one safetensors file of shards per rank, DCP's own
sharded Hugging Face format). Then, alternating round by round, each is turned into the same Hugging
Face layout of full tensors (``model-0000x-of-0000y.safetensors`` of at most ``--max-shard-size``
plus ``model.safetensors.index.json``):

- ckptd: :func:`ckptd.export.export_safetensors` with ``consolidate=True`` (every chunk verified
  against its xxh3-128 digest on the way);
- DCP: ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files``, what
  ``HuggingFaceStorageWriter(enable_consolidation=True)`` runs at the end of a save (no verification:
  safetensors files carry no digests), with the same file split.

Both outputs are checked to hold the same tensors, byte for byte. Reported: median seconds and GB/s of
each, and the ratio, with the input in the page cache ("warm") and evicted from it before each run
with ``posix_fadvise(DONTNEED)`` after an fsync ("cold", as far as a process without root can make
it). Outputs are fsynced by ckptd; DCP's are fsynced after its call inside the timed region, so both
times include getting the bytes to disk.

Usage: ``python benchmarks/bench_export.py [--size 1GiB] [--tensor-size 64MiB] [--repeats 3]
[--max-shard-size 512MB] [--threads 1] [--dir DIR] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}


def _size(text: str) -> int:
    lowered = text.strip().lower()
    for unit, factor in sorted(_UNITS.items(), key=lambda item: -len(item[0])):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def _save(rank: int, world_size: int, ckptd_root: str, hf_root: str, count: int, elements: int) -> None:
    """Every rank: build its shards of ``count`` tensors of ``elements`` fp32 values and save both ways."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptd

    mesh = init_device_mesh("cpu", (world_size,))
    rows = elements // 1024
    state = {}
    for number in range(count):
        local = torch.randn(rows // world_size, 1024, generator=torch.Generator().manual_seed(number * 100 + rank))
        state[f"layers.{number}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                              shape=torch.Size([rows, 1024]),
                                                              stride=(1024, 1))
    with ckptd.CheckpointManager(ckptd_root, capture_rng=False) as manager:
        manager.save(1, {"model": state}, force=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(hf_root, save_distributed=True))


def _evict(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _mapping(keys: list[str], nbytes: dict[str, int], max_shard_bytes: int) -> dict[str, int]:
    """The file number of each key, split in order as ckptd splits (so both write the same files)."""
    mapping, number, size = {}, 1, 0
    for key in keys:
        if size and size + nbytes[key] > max_shard_bytes:
            number, size = number + 1, 0
        mapping[key] = number
        size += nbytes[key]
    return mapping


def _same_output(first: Path, second: Path) -> None:
    from safetensors import safe_open

    def tensors(directory: Path) -> dict[str, bytes]:
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    found[key] = handle.get_tensor(key).reshape(-1).view(dtype=__import__("torch").uint8) \
                        .numpy().tobytes()
        return found

    a, b = tensors(first), tensors(second)
    if a.keys() != b.keys() or any(a[key] != b[key] for key in a):
        raise SystemExit("the two exports differ")


def measure(size: int, tensor_size: int, repeats: int, max_shard_size: int, threads: int,
            directory: str | None) -> dict[str, Any]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    from ckptd.export import ExportOptions, export_safetensors
    from ckptd.testing import run_multirank

    elements = max(tensor_size // 4 // 2048 * 2048, 2048)
    count = max(size // (elements * 4), 1)
    root = Path(tempfile.mkdtemp(prefix="ckptd-bench-export-", dir=directory))
    try:
        ckptd_root, hf_root = root / "ckptd", root / "hf-sharded"
        run_multirank(_save, 2, str(ckptd_root), str(hf_root), count, elements, timeout_s=1800)
        keys = [f"layers.{number}.weight" for number in range(count)]
        mapping = _mapping(keys, dict.fromkeys(keys, elements * 4), max_shard_size)
        total = count * elements * 4
        times: dict[str, list[float]] = {f"{who} {cache}": [] for cache in ("warm", "cold")
                                         for who in ("ckptd", "dcp")}
        for round_number in range(repeats + 1):  # round 0 warms up (imports, page cache)
            for cache in ("warm", "cold"):
                for who in ("ckptd", "dcp"):
                    out = root / f"out-{who}"
                    shutil.rmtree(out, ignore_errors=True)
                    if cache == "cold":
                        _evict(ckptd_root if who == "ckptd" else hf_root)
                    start = time.perf_counter()
                    if who == "ckptd":
                        export_safetensors(str(ckptd_root), 1, out, ExportOptions(
                            consolidate=True, key_prefix="model", max_shard_size=max_shard_size))
                    else:
                        out.mkdir()
                        consolidate_safetensors_files(str(hf_root), str(out), mapping, num_threads=threads)
                        _fsync_tree(out)
                    elapsed = time.perf_counter() - start
                    if round_number:
                        times[f"{who} {cache}"].append(elapsed)
        _same_output(root / "out-ckptd", root / "out-dcp")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result: dict[str, Any] = {"bytes": total, "tensors": count, "repeats": repeats, "dcp_threads": threads,
                              "files": max(mapping.values()), "seconds": medians,
                              "gb_per_s": {name: total / 1e9 / seconds for name, seconds in medians.items()}}
    result["ratio_dcp_over_ckptd"] = {cache: medians[f"dcp {cache}"] / medians[f"ckptd {cache}"]
                                      for cache in ("warm", "cold")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensor-size", default="64MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-shard-size", default="512MB")
    parser.add_argument("--threads", type=int, default=1, help="DCP's num_threads (its default is 1)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(_size(args.size), _size(args.tensor_size), args.repeats, _size(args.max_shard_size),
                     args.threads, args.dir)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{result['bytes'] / 2**30:.2f} GiB fp32 in {result['tensors']} tensors sharded over 2 ranks -> "
          f"{result['files']} files, median of {result['repeats']}")
    for name, seconds in result["seconds"].items():
        print(f"  {name:<11} {seconds:7.2f} s  {result['gb_per_s'][name]:6.2f} GB/s")
    for cache, ratio in result["ratio_dcp_over_ckptd"].items():
        print(f"  {cache}: DCP takes {ratio:.2f}x ckptd's time")


if __name__ == "__main__":
    main()
