"""LocalStack's S3 against moto's: ckptd's promotion and restore throughput on each (not part of the test run).

Starts moto's server (:class:`~ckptd.embedded_s3.EmbeddedS3`) and LocalStack's own S3 provider in host mode
(``tests/s3compat/run.py``'s :func:`start_localstack`, from the venv ``make test-s3-compat`` makes), then runs
``benchmarks/bench_s3.py``'s transfer cases (verified promotion of one step, verified restore into memory, and
s3fs and boto3 moving the same bytes) on both, alternating servers round by round so that a change in the
machine's load hits both alike; the best round of each case counts. Prints GB/s per case and server and the
ratio LocalStack / moto.

Usage: ``python benchmarks/bench_s3_compat.py --localstack-python .venv-s3compat/bin/python [--mib 64]
[--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "s3compat"))

from bench_s3 import _Bench  # noqa: E402
from run import start_localstack, stop, _free_port  # noqa: E402

from ckptd.embedded_s3 import EmbeddedS3  # noqa: E402

CASES = ("promote_verified", "restore_verified", "s3fs.put", "boto3.upload", "s3fs.cat", "boto3.download")


class _LocalStack(EmbeddedS3):
    """LocalStack as the benchmark's server (started and stopped by this script)."""

    def start(self) -> EmbeddedS3:
        return self

    def stop(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--localstack-python", required=True)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-s3-compat-") as scratch:
        workdir = Path(scratch)
        (workdir / "localstack").mkdir()
        process, endpoint = start_localstack(args.localstack_python, _free_port(), workdir / "localstack")
        address = urlsplit(endpoint)
        try:
            with EmbeddedS3() as moto:
                servers = {"moto": moto, "localstack": _LocalStack(host=address.hostname or "127.0.0.1",
                                                                   port=address.port or 80)}
                best: dict[str, dict[str, float]] = {name: {} for name in servers}
                for round_number in range(args.rounds):
                    for name, server in servers.items():
                        directory = workdir / f"{name}-{round_number}"
                        directory.mkdir()
                        figures = _Bench(server, directory).transfer(args.mib, 1)["GB_per_s"]
                        for case in CASES:
                            best[name][case] = max(best[name].get(case, 0.0), figures[case])
        finally:
            stop(process)
    ratios = {case: best["localstack"][case] / best["moto"][case] for case in CASES}
    if args.json:
        print(json.dumps({"mib": args.mib, "rounds": args.rounds, "GB_per_s": best, "localstack_over_moto": ratios},
                         indent=2))
        return 0
    print(f"{args.mib} MiB step, best of {args.rounds} rounds, GB/s")
    print(f"{'case':20} {'moto':>8} {'LocalStack':>11} {'ratio':>7}")
    for case in CASES:
        print(f"{case:20} {best['moto'][case]:8.3f} {best['localstack'][case]:11.3f} {ratios[case]:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
