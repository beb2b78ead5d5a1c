"""The fault matrix's long mode: run rows N times, write the results as JSON, merge results into the report.

Run rows (seeds ``seed_for(row, 0..N-1)``, the short mode's seeds first)::

    python tests/matrix/long_run.py --rows 1-3,13 --runs 100 --runs-for 1=500 --out reports/fault-matrix/crash.json

Without ``--runs`` each scenario runs its ``long_runs`` times; ``--jobs N`` spreads the runs over N worker
processes; the results file is rewritten every 10 runs (a run stopped early keeps what it did), and
``--first-run K`` runs a further batch (seeds from index K) that ``--merge`` joins to the earlier ones. Merge
every results file into the report and the table of docs/fault-matrix.md (one command; the findings file
``reports/fault-matrix/findings.json``, every failure found with its cause, fix and regression test, becomes
the report's findings section)::

    python tests/matrix/long_run.py --merge 'reports/fault-matrix/*.json' \\
        --markdown reports/fault-matrix/REPORT.md --readme docs/fault-matrix.md

Replay one run, keeping its scratch directory and printing its traceback::

    python tests/matrix/long_run.py --replay 1:500123            # every scenario of row 1 with that seed
    python tests/matrix/long_run.py --replay 1:kill_at_a_random_data_write:500123

Exit status: 0 when every run held (or the merge was written), 1 when some run did not hold, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import glob
import shlex
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

ROWS_DIRECTORY = Path(__file__).resolve().parent
REPO = ROWS_DIRECTORY.parent.parent
for _directory in (REPO, REPO / "tests"):  # run as a script from a checkout: ckptd and tests/harness
    if str(_directory) not in sys.path:
        sys.path.insert(0, str(_directory))

import harness  # noqa: E402
from harness import matrix, matrix_report  # noqa: E402

harness.reach_from_subprocesses()

FINDINGS = REPO / "reports" / "fault-matrix" / "findings.json"
MERGE_COMMAND = ("python tests/matrix/long_run.py --merge 'reports/fault-matrix/*.json' "
                 "--markdown reports/fault-matrix/REPORT.md --readme docs/fault-matrix.md")


def parse_rows(text: str) -> list[int]:
    """``"1-3,13"`` -> ``[1, 2, 3, 13]``."""
    numbers: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rows: {part!r} is not a row number or a range like 1-3") from None
        if first > last:
            raise argparse.ArgumentTypeError(f"--rows: empty range {part!r}")
        numbers.update(range(first, last + 1))
    return sorted(numbers)


def parse_runs_for(values: list[str]) -> dict[int, int]:
    """``["1=500"]`` -> ``{1: 500}``."""
    runs: dict[int, int] = {}
    for value in values:
        number, _, count = value.partition("=")
        try:
            runs[int(number)] = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--runs-for: {value!r} is not ROW=RUNS") from None
    return runs


def _worker_init() -> None:
    matrix.discover(ROWS_DIRECTORY)


def _run_one(number: int, scenario: str, seed: int, keep_failed: bool) -> matrix.RunRecord:
    (entry,) = matrix.find_scenario(number, scenario)
    return matrix.run_row(entry, seed, keep_failed=keep_failed)


def run_rows(entries: list[matrix.Row], runs: dict[str, int], *, jobs: int = 1, keep_failed: bool = False,
             progress: bool = True, first_run: int = 0,
             save: Callable[[list[tuple[matrix.Row, list[matrix.RunRecord]]]], None] | None = None,
             save_every: int = 10) -> list[tuple[matrix.Row, list[matrix.RunRecord]]]:
    """Run each entry ``runs[scenario name]`` times (seeds ``seed_for(row, first_run + i)``), in this process
    or on ``jobs`` worker processes; returns the records per entry in seed order. ``save`` gets the records
    so far every ``save_every`` runs (a run stopped early keeps them)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    most = max(runs.values(), default=0)  # interleaved: a run stopped early has some of every scenario
    tasks = [(entry, matrix.seed_for(entry.number, index)) for index in range(first_run, first_run + most)
             for entry in entries if index < first_run + runs[entry.scenario.__name__]]
    records: dict[str, list[matrix.RunRecord]] = {entry.scenario.__name__: [] for entry in entries}
    failed = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    def so_far() -> list[tuple[matrix.Row, list[matrix.RunRecord]]]:
        return [(entry, sorted(records[entry.scenario.__name__], key=lambda r: r.seed)) for entry in entries
                if records[entry.scenario.__name__]]

    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("fault matrix", total=len(tasks))

        def done(record: matrix.RunRecord) -> None:
            nonlocal failed
            records[record.scenario].append(record)
            if not record.outcome.held:
                failed += 1
                bar.console.print(f"[red]row {record.number} {record.scenario} seed {record.seed} did not hold: "
                                  f"{record.outcome.detail}[/red]")
            bar.update(task, advance=1, description=f"row {record.number} {record.scenario} ({failed} failed)")
            finished = int(bar.tasks[0].completed)
            if save is not None and finished % save_every == 0 and finished < len(tasks):
                save(so_far())
            if not progress and (finished % 25 == 0 or finished == len(tasks)):  # a log line instead of the bar
                print(f"{finished}/{len(tasks)} runs, {failed} not held", flush=True)

        if jobs <= 1:
            for entry, seed in tasks:
                done(matrix.run_row(entry, seed, keep_failed=keep_failed))
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"),
                                     initializer=_worker_init) as pool:
                futures = [pool.submit(_run_one, entry.number, entry.scenario.__name__, seed, keep_failed)
                           for entry, seed in tasks]
                for future in as_completed(futures):
                    done(future.result())
    return so_far()


def replay(spec: str) -> int:
    """Rerun ``ROW:SEED`` or ``ROW:SCENARIO:SEED`` with its scratch directory kept; 0 when it held."""
    parts = spec.split(":")
    try:
        number, name, seed = (int(parts[0]), None, int(parts[1])) if len(parts) == 2 else \
            (int(parts[0]), parts[1], int(parts[2]))
    except (ValueError, IndexError):
        print(f"--replay: {spec!r} is not ROW:SEED or ROW:SCENARIO:SEED", file=sys.stderr)
        return 2
    try:
        entries = matrix.find_scenario(number, name)
    except KeyError as error:
        print(f"--replay: {error.args[0]}", file=sys.stderr)
        return 2
    status = 0
    for entry in entries:
        record = matrix.run_row(entry, seed, keep=True)
        outcome = record.outcome
        print(f"row {entry.number} {record.scenario} seed {seed}: {'held' if outcome.held else 'NOT HELD'} "
              f"(checked {', '.join(outcome.checked)}; recovery {outcome.recovery_s}; step recovery "
              f"{outcome.step_recovery_s}; bytes lost {outcome.bytes_lost}; {record.wall_s:.2f} s)")
        if outcome.detail:
            print(f"  detail: {outcome.detail}")
        if record.error:
            print(record.error, end="")
        print(f"  scratch directory kept: {record.workdir}")
        status = status or (0 if outcome.held else 1)
    return status


def merge(patterns: list[str], markdown: str | None, readme: str | None) -> int:
    paths = sorted({path for pattern in patterns for path in glob.glob(pattern)
                    if Path(path).resolve() != FINDINGS.resolve()})
    if not paths:
        print(f"--merge: no results file matches {' '.join(patterns)}", file=sys.stderr)
        return 2
    merged = matrix_report.merge_results(matrix_report.load_results(paths), matrix.scenarios())
    findings = matrix_report.load_findings(FINDINGS) if FINDINGS.exists() else None
    if markdown:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(matrix_report.markdown_report(merged, command=MERGE_COMMAND, findings=findings))
        print(f"wrote {markdown} from {len(paths)} results file(s)")
    if readme:
        text = Path(readme).read_text()
        Path(readme).write_text(matrix_report.replace_marked_block(text, matrix_report.readme_block(
            merged, command=MERGE_COMMAND, findings=findings)))
        print(f"updated the fault-matrix table in {readme}")
    if not markdown and not readme:
        print("\n".join(matrix_report.table_lines(merged)))
    total = matrix_report.totals(merged)
    print(f"{total['runs']} runs, {total['held']} held, {total['bytes_lost']} bytes lost")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_rows, default=None, help="rows to run, e.g. 1-3,13 (default: all)")
    parser.add_argument("--scenario", default=None, help="only the scenario of this name")
    parser.add_argument("--runs", type=int, default=None, help="runs per scenario (default: its long_runs)")
    parser.add_argument("--runs-for", action="append", default=[], metavar="ROW=RUNS",
                        help="runs for one row, overriding --runs (may be repeated)")
    parser.add_argument("--first-run", type=int, default=0,
                        help="index of the first run (seeds go on from an earlier batch; --merge joins batches)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1: this process)")
    parser.add_argument("--out", default=None, help="JSON results file to write")
    parser.add_argument("--keep-failed", action="store_true", help="keep the scratch directories of failed runs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--merge", nargs="+", default=None, metavar="GLOB", help="results files to merge")
    parser.add_argument("--markdown", default=None, help="with --merge: the report file to write")
    parser.add_argument("--readme", default=None,
                        help="with --merge: the Markdown page (docs/fault-matrix.md) whose fault-matrix block to update")
    parser.add_argument("--replay", default=None, metavar="ROW:[SCENARIO:]SEED", help="rerun one run, keeping it")
    args = parser.parse_args(argv)
    try:
        runs_for = parse_runs_for(args.runs_for)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    matrix.discover(ROWS_DIRECTORY)
    # SIGTERM (kill, a timeout) ends through the finally below: the moto server this process started stops
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.merge is not None:
            return merge(args.merge, args.markdown, args.readme)
        if args.replay is not None:
            return replay(args.replay)
        if args.out is None:
            parser.error("--out FILE is needed to run rows (or use --merge / --replay)")
        wanted = set(args.rows) if args.rows is not None else None
        entries = [entry for entry in matrix.scenarios() if entry.scenario is not None
                   and (wanted is None or entry.number in wanted)
                   and (args.scenario is None or entry.scenario.__name__ == args.scenario)]
        if not entries:
            parser.error("no runnable scenario matches --rows/--scenario")
        runs = {entry.scenario.__name__: runs_for.get(entry.number, args.runs or entry.long_runs)
                for entry in entries}
        not_runnable = [entry for entry in matrix.scenarios() if entry.scenario is None
                        and (wanted is None or entry.number in wanted)]
        command = shlex.join(["python", "tests/matrix/long_run.py", *argv])

        def save(results: list[tuple[matrix.Row, list[matrix.RunRecord]]]) -> Path:
            return matrix_report.write_results(args.out, matrix_report.results_document(
                results, command=command, not_runnable=not_runnable))

        results = run_rows(entries, runs, jobs=args.jobs, keep_failed=args.keep_failed,
                           progress=not args.no_progress, first_run=args.first_run, save=save)
        path = save(results)
        held = all(record.outcome.held for _, records in results for record in records)
        for entry, records in results:
            summary = matrix.summarise(entry, records)
            print(f"row {summary.number} {summary.scenario}: {summary.held}/{summary.runs} held, worst recovery "
                  f"{summary.worst_recovery_s}, bytes lost {summary.bytes_lost}"
                  + (f", failing seeds {list(summary.failed_seeds)}" if summary.failed_seeds else ""))
        print(f"wrote {path}")
        return 0 if held else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        matrix.stop_shared_endpoints()


if __name__ == "__main__":
    raise SystemExit(main())
