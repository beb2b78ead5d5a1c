"""torchrun's logging options under ``ckptd launch``: ``--log-dir``, ``--redirects``, ``--tee``,
``--local-ranks-filter`` and the console's line prefixes, each through a real 2-rank ``ckptd launch`` with a
SIGKILL and a restart: a script that does not use ckptd gets a new ``attempt_<N>`` folder per whole-group
restart, as under torchrun; a ckptd-aware rank restarted alone, or the warm spare that takes its place, goes
on writing the rank's files of its attempt."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

SCRIPTS = Path(__file__).parent / "scripts"


def _launch(tmp_path: Path, *options: str, mode: str = "plain", extra_env: dict[str, str] | None = None,
            job_args: tuple[str, ...] = (), code: int = 0) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out"
    out.mkdir()
    env = {name: value for name, value in os.environ.items() if name != "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"}
    env.update(OMP_NUM_THREADS="1", **(extra_env or {}))
    budget = () if "--max-restarts" in options else ("--max-restarts", "1")
    script = SCRIPTS / ("launch_logs_aware_job.py" if mode == "aware" else "launch_logs_job.py")
    done = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "launch", "--standalone", "--nproc-per-node", "2",
                           "--rdzv-id", "job7", *options, *budget, str(script), mode, str(out), *job_args],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == code, done.stderr[-4000:]
    return done


def _run_dir(logs: Path) -> Path:
    runs = list(logs.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("job7_"), runs
    return runs[0]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("preload", ["--preload", "--no-preload"])
def test_whole_group_restarts_write_a_new_attempt_folder_with_torchruns_per_rank_routes(tmp_path: Path,
                                                                                      preload: str) -> None:
    # local rank 0: both streams to files, stdout also to the console; local rank 1: stdout to its file only,
    # stderr to the console as it is
    done = _launch(tmp_path, preload, "--log-dir", str(tmp_path / "logs"), "--redirects", "0:3,1:1", "--tee", "0:1")
    run = _run_dir(tmp_path / "logs")
    assert sorted(path.name for path in run.iterdir()) == ["attempt_0", "attempt_1"]
    for attempt in (0, 1):
        folder = run / f"attempt_{attempt}"
        assert f"out rank 0 attempt {attempt} " in _read(folder / "0" / "stdout.log")
        assert f"err rank 0 attempt {attempt} " in _read(folder / "0" / "stderr.log")
        assert _read(folder / "1" / "stdout.log").startswith(f"out rank 1 attempt {attempt} ")
        assert not (folder / "1" / "stderr.log").exists(), "rank 1's stderr was not redirected"
        assert f"attempt {1 - attempt}" not in _read(folder / "0" / "stdout.log") + _read(folder / "1" / "stdout.log")
        assert re.search(rf"^\[default0\]:out rank 0 attempt {attempt} pid \d+$", done.stdout, re.M), done.stdout
        assert re.search(rf"^err rank 1 attempt {attempt} pid \d+$", done.stderr, re.M), done.stderr[-3000:]
    assert "out rank 1" not in done.stdout + done.stderr, "a stream redirected (not teed) reached the console"
    assert "err rank 0" not in done.stdout + done.stderr, "a stream redirected (not teed) reached the console"
    assert "restarting the whole group" in done.stderr and "recovery: the whole group, as torchrun" in done.stderr


def test_the_filter_shows_only_the_listed_local_ranks_with_the_prefix_template(tmp_path: Path) -> None:
    # without --log-dir the teed files go under a temporary folder, as under torchrun
    done = _launch(tmp_path, "--tee", "1", "--local-ranks-filter", "1",
                   extra_env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"})
    for attempt in (0, 1):
        assert re.search(rf"^\[rank1\]:out rank 1 attempt {attempt} pid \d+$", done.stdout, re.M), done.stdout
        assert re.search(rf"^err rank 1 attempt {attempt} pid \d+$", done.stderr, re.M), done.stderr[-3000:]
    assert "rank 0 attempt" not in done.stdout + done.stderr, "local rank 0 is filtered out of the console"
    folder = re.search(r"the ranks' logs go under (\S+)", done.stderr)
    assert folder is not None, done.stderr[-3000:]
    run = Path(folder.group(1))
    try:
        assert "out rank 0 attempt 1 " in _read(run / "attempt_1" / "0" / "stdout.log"), "the file keeps every rank"
        assert not (run / "attempt_1" / "0" / "stderr.log").exists()
    finally:
        shutil.rmtree(run.parent, ignore_errors=True)


@pytest.mark.parametrize("spares", [0, 1])
def test_a_rank_restarted_alone_or_its_spare_writes_the_ranks_files(tmp_path: Path, spares: int) -> None:
    done = _launch(tmp_path, "--spares", str(spares), "--log-dir", str(tmp_path / "logs"), "--redirects", "2",
                   "--tee", "1", mode="aware", job_args=("spare",) if spares else ())
    assert "recovery: rank by rank" in done.stderr
    run = _run_dir(tmp_path / "logs")
    assert [path.name for path in run.iterdir()] == ["attempt_0"], "a rank restarted alone stays in its attempt"
    stdout, stderr = (_read(run / "attempt_0" / "1" / name) for name in ("stdout.log", "stderr.log"))
    first = re.search(r"out rank 1 gen 0 pid (\d+)", stdout)
    second = re.search(r"out rank 1 gen 1 pid (\d+)", stdout)
    assert first and second and first.group(1) != second.group(1), stdout
    assert f"err rank 1 gen 0 pid {first.group(1)}" in stderr and f"err rank 1 gen 1 pid {second.group(1)}" in stderr
    assert "rank 0" not in stdout + stderr and "rank 1" not in _read(run / "attempt_0" / "0" / "stdout.log")
    assert f"[default1]:out rank 1 gen 1 pid {second.group(1)}" in done.stdout.splitlines(), done.stdout
    assert "err rank" not in done.stdout + done.stderr, "stderr is redirected, not teed"
    if spares:
        assert f"to warm spare 0 (pid {second.group(1)})" in done.stderr, done.stderr[-3000:]
        # what the spare printed before it became rank 1 is not rank 1's
        assert f"spare setup pid {second.group(1)}" in done.stdout and "spare setup" not in stdout


@pytest.mark.parametrize("preload", ["--preload", "--no-preload"])
def test_an_uncaught_exception_in_a_rank_is_printed_with_torchs_rank_prefix(tmp_path: Path, preload: str) -> None:
    # torch's excepthook (installed by init_process_group) prefixes each line with [rankN]: as under torchrun;
    # teed, the line gets torchrun's console prefix in front of it, and the file keeps it as the rank wrote it
    done = _launch(tmp_path, preload, "--max-restarts", "0", "--tee", "0:0,1:2", "--log-dir", str(tmp_path / "logs"),
                   mode="raise", code=12)
    lines = done.stderr.splitlines()
    assert "[default1]:[rank1]: Traceback (most recent call last):" in lines, done.stderr[-3000:]
    assert "[default1]:[rank1]: RuntimeError: boom from rank 1" in lines, done.stderr[-3000:]
    assert "Process ckptd-rank" not in done.stderr, "multiprocessing printed a traceback, not sys.excepthook"
    stderr = _read(_run_dir(tmp_path / "logs") / "attempt_0" / "1" / "stderr.log").splitlines()
    assert "[rank1]: RuntimeError: boom from rank 1" in stderr, stderr


def test_teed_lines_reach_the_console_whole_and_the_last_unfinished_one_at_the_end(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptd.elastic.log_routing import LogRouter, LogSpec

    router = LogRouter(LogSpec(log_dir=str(tmp_path), tee={0: 1}, redirects={1: 2}), "job", "trainer", {0: 4, 1: 5})
    router.open_attempt(3)
    variables = router.variables(0)
    assert variables["CKPTD_LOG_STDOUT"].endswith(os.path.join("attempt_3", "0", "stdout.log"))
    assert "CKPTD_LOG_STDERR" not in variables and "CKPTD_LOG_STDOUT" not in router.variables(1)
    with open(variables["CKPTD_LOG_STDOUT"], "a") as rank:
        rank.write("one\ntw")
        rank.flush()
        router.pump()
        assert capsys.readouterr().out == "[trainer0]:one\n"
        rank.write("o\nthree")
    router.close()
    assert capsys.readouterr().out == "[trainer0]:two\n[trainer0]:three\n"
