"""Throughput of plain ``dcp.save``/``dcp.load`` with DCP's ``FileSystemWriter``/``FileSystemReader``
against ckptd's ``CkptdStorageWriter``/``CkptdStorageReader`` (not part of the test run).

One state (float32 tensors of ``--tensor-mib`` MiB each, ``--total-mib`` MiB in all, plus a few small
ones and values), one process per measurement (a fresh interpreter, so no writer or buffer is warm),
alternating the two plugins for ``--rounds`` rounds; the best round of each is reported. A save is
timed to its return (durable: both fsync their files); a load reads the step just saved, after
``posix_fadvise(DONTNEED)`` on its files unless ``--warm-cache``, and is bit-checked. ckptd also hashes
(xxh3-128) every chunk on save and verifies every chunk on load; FileSystemWriter does neither.

Usage: ``python benchmarks/bench_dcp_plain.py [--total-mib 1024] [--tensor-mib 64] [--rounds 3]
[--codec raw] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _state(total_mib: int, tensor_mib: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    count = max(1, total_mib // tensor_mib)
    elements = tensor_mib * (1 << 20) // 4
    state: dict[str, Any] = {f"layer{i}.weight": torch.randn(elements, generator=generator) for i in range(count)}
    state.update({f"layer{i}.bias": torch.randn(1024, generator=generator) for i in range(count)})
    state["step"] = 1000
    return state


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno()) if os.access(path, os.W_OK) else None
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = _state(args.total_mib, args.tensor_mib)
    nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    directory = Path(args.directory)
    if args.plugin == "dcp":
        writer: Any = dcp.FileSystemWriter(str(directory), thread_count=args.threads)
        reader: Any = dcp.FileSystemReader(str(directory))
    else:
        from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter

        writer, reader = CkptdStorageWriter(directory, step=0, codec=args.codec), CkptdStorageReader(directory, 0)
    started = time.perf_counter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    save_s = time.perf_counter() - started
    if not args.warm_cache:
        _drop_cache(directory)
    loaded = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    started = time.perf_counter()
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    load_s = time.perf_counter() - started
    if any(not torch.equal(loaded[k], v) for k, v in state.items() if isinstance(v, torch.Tensor)):
        raise SystemExit("loaded bytes differ")
    stored = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    print(json.dumps({"plugin": args.plugin, "bytes": nbytes, "stored_bytes": stored, "save_s": save_s,
                      "load_s": load_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="raw", help="ckptd's codec (raw, zstd, byteplane)")
    parser.add_argument("--threads", type=int, default=1, help="FileSystemWriter's thread_count")
    parser.add_argument("--warm-cache", action="store_true", help="load from the page cache")
    parser.add_argument("--scratch", default=None, help="directory for the checkpoints (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plugin", choices=("dcp", "ckptd"), help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plugin:
        _child(args)
        return

    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        for round_number in range(args.rounds):
            for plugin in ("dcp", "ckptd"):
                directory = Path(scratch) / f"{plugin}-{round_number}"
                command = [sys.executable, __file__, "--plugin", plugin, "--directory", str(directory),
                           "--total-mib", str(args.total_mib), "--tensor-mib", str(args.tensor_mib),
                           "--codec", args.codec, "--threads", str(args.threads)]
                if args.warm_cache:
                    command.append("--warm-cache")
                result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout
                                    .strip().splitlines()[-1])
                for key in ("save_s", "load_s"):
                    mine = best.setdefault(plugin, dict(result))
                    mine[key] = min(mine[key], result[key])
                subprocess.run(["rm", "-rf", str(directory)], check=True)
    gib = best["dcp"]["bytes"] / (1 << 30)
    report = {
        "state_gib": round(gib, 3), "rounds": args.rounds, "codec": args.codec, "warm_cache": args.warm_cache,
        "save_gib_s": {p: round(gib / best[p]["save_s"], 3) for p in best},
        "load_gib_s": {p: round(gib / best[p]["load_s"], 3) for p in best},
        "stored_gib": {p: round(best[p]["stored_bytes"] / (1 << 30), 3) for p in best},
        "save_ratio_ckptd_over_dcp": round(best["dcp"]["save_s"] / best["ckptd"]["save_s"], 3),
        "load_ratio_ckptd_over_dcp": round(best["dcp"]["load_s"] / best["ckptd"]["load_s"], 3),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"state {report['state_gib']} GiB, best of {args.rounds} fresh processes each, codec {args.codec}")
    for plugin in ("dcp", "ckptd"):
        print(f"  {plugin:6s} save {report['save_gib_s'][plugin]:7.3f} GiB/s   load {report['load_gib_s'][plugin]:7.3f}"
              f" GiB/s   stored {report['stored_gib'][plugin]} GiB")
    print(f"  ckptd/dcp throughput: save x{report['save_ratio_ckptd_over_dcp']}, "
          f"load x{report['load_ratio_ckptd_over_dcp']}")


if __name__ == "__main__":
    main()
