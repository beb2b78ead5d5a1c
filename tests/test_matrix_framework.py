"""The fault-matrix framework itself: runs and their records, summaries, the coverage check, the long
mode's JSON, merge, Markdown and README block, ``--replay``, and the invariant checkers (each shown to
fail on the fault it exists to catch)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from harness import invariants as inv
from harness import matrix, matrix_report
from harness.matrix import Outcome, Row, RunContext
from ckptd.testing.tamper import data_path, step_path

LONG_RUN = Path(__file__).parent / "matrix" / "long_run.py"
WORKLOAD = inv.SyntheticWorkload(64 * 1024)


def _long_run():
    spec = importlib.util.spec_from_file_location("ckptd_matrix_long_run", LONG_RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raises_on_odd_seeds(ctx: RunContext) -> Outcome:
    (ctx.workdir / "left-behind").write_text("scratch")
    if ctx.seed % 2:
        raise RuntimeError(f"boom at {ctx.rng.random()}")
    return Outcome(held=True, checked=("L1",), recovery_s=float(ctx.seed % 10), bytes_lost=0)


def loses_bytes(ctx: RunContext) -> Outcome:
    return Outcome(held=False, checked=("L2",), recovery_s=0.5, bytes_lost=7, detail="lost seven bytes")


def draws(ctx: RunContext) -> Outcome:
    return Outcome(held=True, checked=("L5",), detail=repr([ctx.rng.random() for _ in range(3)]))


def _entry(fn, number: int = 99) -> Row:
    return Row(number, f"test row {number}", fn, short_runs=1, long_runs=4)


def test_a_scenario_that_raises_is_not_held_and_keeps_its_seed_traceback_and_scratch() -> None:
    record = matrix.run_row(_entry(raises_on_odd_seeds), 7, keep_failed=True)
    try:
        assert not record.outcome.held and record.seed == 7 and record.number == 99
        assert "RuntimeError: boom" in record.error and "boom" in record.outcome.detail
        assert (Path(record.workdir) / "left-behind").read_text() == "scratch"
    finally:
        shutil.rmtree(record.workdir, ignore_errors=True)
    held = matrix.run_row(_entry(raises_on_odd_seeds), 8, keep_failed=True)
    assert held.outcome.held and held.error == "" and held.workdir == "", "a run that held leaves no scratch"


def test_runs_are_deterministic_given_the_seed() -> None:
    first, again, other = (matrix.run_row(_entry(draws), seed) for seed in (5, 5, 6))
    assert first.outcome.detail == again.outcome.detail != other.outcome.detail
    assert matrix.seed_for(1, 0) != matrix.seed_for(1, 1) != matrix.seed_for(2, 0)


def test_summaries_fold_runs_into_held_recovery_bytes_and_failing_seeds() -> None:
    entry = _entry(raises_on_odd_seeds)
    records = [matrix.run_row(entry, seed) for seed in (2, 3, 4, 5, 6)]
    summary = matrix.summarise(entry, records)
    assert (summary.runs, summary.held, summary.failed_seeds) == (5, 3, (3, 5))
    assert (summary.median_recovery_s, summary.worst_recovery_s, summary.bytes_lost) == (4.0, 6.0, 0)
    lossy = matrix.summarise(_entry(loses_bytes), [matrix.run_row(_entry(loses_bytes), s) for s in (1, 2)])
    assert lossy.bytes_lost == 14 and lossy.held == 0


def test_the_coverage_check_names_the_missing_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrix, "ROWS", {})
    matrix.row(1, "one")(draws)
    matrix.not_runnable(3, "three", reason="needs a GPU", covered_by="tests/test_x.py")
    assert matrix.missing_rows(range(1, 5)) == [2, 4]
    assert [entry.number for entry in matrix.scenarios()] == [1, 3]
    with pytest.raises(KeyError, match="no runnable scenario"):
        matrix.find_scenario(3)


def _document(entries_and_seeds, command="cmd"):
    runs = [(entry, [matrix.run_row(entry, seed) for seed in seeds]) for entry, seeds in entries_and_seeds]
    not_here = Row(98, "needs root", None, 0, 0, "no root here", "tests/test_faults_enospc.py")
    return matrix_report.results_document(runs, command=command, not_runnable=[not_here])


def test_results_merge_into_the_report_and_the_readme_block(tmp_path: Path) -> None:
    older = matrix_report.write_results(tmp_path / "a.json", _document([(_entry(raises_on_odd_seeds), [2, 3])]))
    newer_doc = _document([(_entry(raises_on_odd_seeds), [2, 4, 6]), (_entry(loses_bytes, 97), [1])])
    newer_doc["generated"] = "9999-01-01T00:00:00+00:00"  # sorts after the first file
    newer = matrix_report.write_results(tmp_path / "b.json", newer_doc)
    merged = matrix_report.merge_results(matrix_report.load_results([older, newer]))
    by_row = {s["number"]: s["summary"] for s in merged["scenarios"]}
    assert by_row[99]["runs"] == 4 and by_row[99]["held"] == 3, "batches join by seed (2, 3, 4, 6)"
    assert by_row[99]["failed_seeds"] == [3]
    assert by_row[97]["bytes_lost"] == 7 and by_row[97]["failed_seeds"] == [1]
    report = matrix_report.markdown_report(merged, command="make matrix")
    assert "| 99 | test row 99 | `raises_on_odd_seeds` | 4 | 3 |" in report
    assert "| 97 | test row 97 | `loses_bytes` | 1 | 0 |" in report and "| 7 | 1 |" in report
    assert "| 98 | needs root | no root here | tests/test_faults_enospc.py |" in report
    assert "Rows without long-mode results yet: 1, 2," in report and "make matrix" in report
    readme = "intro\n" + matrix_report.README_START + "\nold table\n" + matrix_report.README_END + "\nafter\n"
    updated = matrix_report.replace_marked_block(readme, matrix_report.readme_block(merged, command="make matrix"))
    assert updated.startswith("intro\n") and updated.endswith("\nafter\n") and "old table" not in updated
    assert "5 runs, 3 held, 7 bytes of committed data lost" in updated
    with pytest.raises(ValueError, match="no fault-matrix block"):
        matrix_report.replace_marked_block("no markers", "x")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="bad.json"):
        matrix_report.load_results([tmp_path / "bad.json"])


def test_a_failure_replaced_by_a_later_run_of_its_seed_stays_in_the_report(tmp_path: Path) -> None:
    entry = _entry(raises_on_odd_seeds)
    failed = _document([(entry, [3])])
    assert failed["revision"] is None or failed["revision"][:7].isalnum(), "the checkout's commit is recorded"
    rerun = json.loads(json.dumps(failed))
    rerun["generated"] = "9999-01-01T00:00:00+00:00"
    rerun["scenarios"][0]["runs"][0]["held"] = True  # the same seed after a fix
    merged = matrix_report.merge_results(matrix_report.load_results([
        matrix_report.write_results(tmp_path / "before.json", failed),
        matrix_report.write_results(tmp_path / "after.json", rerun)]), [entry])
    assert merged["scenarios"][0]["summary"]["failed_seeds"] == [], "the newest run of a seed counts"
    assert [(s["seed"], Path(s["file"]).name, s["held_later"]) for s in merged["superseded"]] == [
        (3, "before.json", True)]
    report = matrix_report.markdown_report(merged, command="make matrix", findings=[])
    assert "- row 99 `raises_on_odd_seeds` seed 3: failed in `before.json`, held in `after.json`" in report
    assert "row 99 `raises_on_odd_seeds` 1 of 4" in report, "a scenario short of its long_runs is named"
    finding = {"source": "matrix", "row": 99, "scenario": "raises_on_odd_seeds", "seeds": [3], "symptom": "boom",
               "cause": "odd seeds", "fix": "abc1234", "regression_test": "tests/test_x.py::test_y"}
    named = matrix_report.markdown_report(merged, command="make matrix", findings=[finding])
    assert "| row 99 | raises_on_odd_seeds | 3 | boom | odd seeds | abc1234 | `tests/test_x.py::test_y` |" in named
    assert "seed 3: failed in" not in named, "a failure a finding names is listed once, as the finding"
    block = matrix_report.readme_block(merged, command="make matrix", findings=[finding])
    assert "found 1 failures (0 defects of ckptd; 1 of the test scenarios or the campaign's setup)" in block


def test_every_committed_finding_names_a_regression_test_that_exists() -> None:
    repository = Path(__file__).resolve().parent.parent
    findings = matrix_report.load_findings(repository / "reports" / "fault-matrix" / "findings.json")
    assert findings, "the campaign's findings are recorded"
    for finding in findings:
        path, _, function = finding["regression_test"].partition("::")
        source = (repository / path).read_text()
        assert not function or f"def {function}(" in source, finding["regression_test"]
        assert finding["symptom"] and finding["cause"], finding
    report = (repository / "reports" / "fault-matrix" / "REPORT.md").read_text()
    assert all(f["regression_test"] in report for f in findings), "REPORT.md was merged with the findings file"


def test_long_run_runs_rows_writes_json_merges_and_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    long_run = _long_run()
    monkeypatch.setitem(matrix.ROWS, 99, [_entry(raises_on_odd_seeds)])
    out = tmp_path / "results" / "r99.json"
    seeds = [matrix.seed_for(99, i) for i in range(3)]
    status = long_run.main(["--rows", "99", "--runs", "3", "--out", str(out), "--no-progress"])
    assert status == (1 if any(seed % 2 for seed in seeds) else 0)
    document = json.loads(out.read_text())
    (scenario,) = document["scenarios"]
    assert [run["seed"] for run in scenario["runs"]] == seeds
    assert [run["held"] for run in scenario["runs"]] == [seed % 2 == 0 for seed in seeds]
    assert all("RuntimeError" in run["error"] for run in scenario["runs"] if not run["held"])
    assert document["machine"]["cores"] and "--rows 99" in document["command"]

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{matrix_report.README_START}\n{matrix_report.README_END}\n")
    report = tmp_path / "REPORT.md"
    assert long_run.main(["--merge", str(tmp_path / "results" / "*.json"), "--markdown", str(report),
                          "--readme", str(readme)]) == 0
    assert "`raises_on_odd_seeds` | 3 |" in report.read_text() and "`raises_on_odd_seeds`" in readme.read_text()

    capsys.readouterr()
    assert long_run.main(["--replay", "99:raises_on_odd_seeds:11"]) == 1
    printed = capsys.readouterr().out
    assert "seed 11: NOT HELD" in printed and "RuntimeError: boom" in printed
    kept = Path(printed.split("scratch directory kept: ")[1].split()[0])
    assert (kept / "left-behind").exists(), "a replay keeps its scratch directory"
    shutil.rmtree(kept)
    assert long_run.main(["--replay", "99:12"]) == 0
    shutil.rmtree(capsys.readouterr().out.split("scratch directory kept: ")[1].split()[0])
    assert long_run.main(["--replay", "99:nonsense"]) == 2
    assert long_run.parse_rows("1-3,13") == [1, 2, 3, 13] and long_run.parse_runs_for(["1=500"]) == {1: 500}


# --- the invariant checkers ----------------------------------------------------------------------

def _saved(root: Path, steps=(1, 2)) -> Path:
    with CheckpointManager(root, policy=Policy(keep_local=None), capture_rng=False, daemon="off") as manager:
        for step in steps:
            manager.save(step, WORKLOAD.state(step), force=True)
            manager.wait()
    return root


def test_l1_restores_the_newest_step_and_catches_wrong_bytes_or_step(tmp_path: Path) -> None:
    root = _saved(tmp_path / "root")
    assert inv.check_newest_restores(WORKLOAD, root).ok
    fresh = inv.check_newest_restores(WORKLOAD, root, fresh_process=True, expected_step=2)
    assert fresh.ok and fresh.facts["step"] == 2 and fresh.facts["tiers"][0].startswith("local")
    assert inv.check_step_restores(WORKLOAD, root, 1).ok and inv.check_newest_restores(WORKLOAD, root, read_only=True).ok
    wrong_step = inv.check_newest_restores(WORKLOAD, root, expected_step=1)
    assert not wrong_step.ok and "loaded step 2, expected 1" in wrong_step.detail
    other = inv.SyntheticWorkload(64 * 1024, rank_stride=10)  # other bytes, same structure
    assert "not bit-exact" in inv.check_newest_restores(other, root).detail
    assert not inv.check_newest_restores(WORKLOAD, tmp_path / "empty").ok


def test_l2_and_l3_catch_a_lost_step_a_rewritten_manifest_and_a_bad_chunk(tmp_path: Path) -> None:
    root = _saved(tmp_path / "root", steps=(1, 2, 3))
    before = inv.record_committed(root)
    assert [c.ok for c in inv.check_committed(before, root)] == [True, True]
    with open(data_path(root, 2), "r+b") as handle:  # one bit of step 2's data
        byte = handle.read(1)
        handle.seek(0)
        handle.write(bytes([byte[0] ^ 1]))
    shutil.rmtree(step_path(root, 1))
    lost, partial = inv.check_committed(before, root)
    assert not lost.ok and lost.bytes_lost == sum(e.total_bytes for e in before.steps if e.step in (1, 2))
    assert "step 1 is gone" in lost.detail and "step 2 no longer verifies" in lost.detail
    assert not partial.ok and "do not verify" in partial.detail
    assert inv.check_nothing_lost(before, root, keep_last=2).detail.count("step 1") == 0, \
        "retention keeping 2 may remove step 1 once steps 2 and 3 are committed"
    assert "never committed" in inv.check_nothing_partial(root, allowed={1, 2}).detail
    outcome = inv.outcome([lost, partial, inv.Check("L1", True)], recovery_s=1.0, detail="note")
    assert not outcome.held and outcome.checked == ("L1", "L2", "L3") and outcome.bytes_lost == lost.bytes_lost
    assert outcome.detail.startswith("note; L2: ")


def test_l3_temporaries_l4_snapshots_and_canaries(tmp_path: Path) -> None:
    root = _saved(tmp_path / "root", steps=(1,))
    assert inv.check_no_temporaries(root).ok
    (step_path(root, 1) / "rank-00000.data.tmp-abc").write_bytes(b"x")
    assert not inv.check_no_temporaries(root).ok
    outside = tmp_path / "outside"
    canary = inv.plant_canary(outside)
    before = inv.snapshot_tree(outside)
    assert inv.check_untouched(before).ok and inv.check_canary(canary).ok
    (outside / "new").write_text("x")
    assert "added: ['new']" in inv.check_untouched(before).detail
    canary.write_text("changed")
    assert not inv.check_canary(canary).ok and not inv.check_untouched(before).ok
    assert inv.check_absent(outside / "pwned").ok and not inv.check_absent(canary).ok


def test_l5_state_digests_and_sample_streams() -> None:
    assert inv.state_digest(WORKLOAD.state(1)) == inv.state_digest(WORKLOAD.state(1))
    assert inv.state_digest(WORKLOAD.state(1)) != inv.state_digest(WORKLOAD.state(2))
    assert inv.state_digest({"x": 0.0}) != inv.state_digest({"x": -0.0}), "floats compare by bit pattern"
    assert inv.check_same_run(["a", "b"], ["a", "b"], "d", "d").ok
    assert "position 1" in inv.check_same_run(["a", "b"], ["a", "c"]).detail
    assert "state hash" in inv.check_same_run(["a"], ["a"], "d1", "d2").detail
