"""``ckptd launch`` parses torchrun's whole command line with torch's own parser: every option of the
installed torch's ``torchrun --help`` (each spelling) is honoured (the supervisor's spec shows it) or refused
with a usage error naming it; through the real CLI, a refused or unknown option exits 2 naming it, and a
job started with torchrun's spellings runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.cli.launch_cmd import parse_launch
from ckptd.errors import ConfigError

Check = Callable[[Any], bool]
REFUSED = "refused"

#: For each option of torchrun's parser: a value to pass (None: a flag) and what the spec must then show,
#: or REFUSED. An option torch adds later is missing here, and the walk below fails until it is decided.
OPTIONS: dict[str, tuple[str | None, Check | str]] = {
    "nnodes": ("1", lambda spec: spec.nnodes == 1),
    "nproc_per_node": ("3", lambda spec: spec.nproc_per_node == 3),
    "rdzv_backend": ("c10d", lambda spec: spec.rdzv_host == "127.0.0.1"),
    "rdzv_endpoint": ("127.0.0.1:29533", lambda spec: (spec.rdzv_host, spec.rdzv_port) == ("127.0.0.1", 29533)),
    "rdzv_id": ("job-7", lambda spec: spec.run_id == "job-7"),
    "rdzv_conf": ("join_timeout=42", lambda spec: spec.join_timeout_s == 42.0),
    "standalone": (None, lambda spec: spec.nnodes == 1 and spec.rdzv_host == "127.0.0.1" and spec.rdzv_port > 0),
    "max_restarts": ("7", lambda spec: spec.max_restarts == 7),
    "monitor_interval": ("0.5", lambda spec: spec.poll_s == 0.5),
    "start_method": ("fork", lambda spec: True),  # torchrun uses it for function entrypoints only, never scripts
    "event_log_handler": ("console", REFUSED),
    "role": ("trainer", lambda spec: spec.role == "trainer"),
    "module": (None, lambda spec: spec.command[2:4] == ("-m", "train.py")),
    "no_python": (None, lambda spec: spec.command[0] == "train.py" and not spec.preload),
    "run_path": (None, lambda spec: spec.command[2] == "train.py"),
    "log_dir": ("logs", lambda spec: spec.logs.log_dir == "logs"),
    "redirects": ("0:3,1:1", lambda spec: spec.logs.redirects == {0: 3}),  # one local rank by default
    "tee": ("2", lambda spec: spec.logs.tee == {0: 2}),
    "local_ranks_filter": ("0,1", lambda spec: spec.logs.local_ranks_filter == {0, 1}),
    "duplicate_stdout_filters": ("0", REFUSED),
    "duplicate_stderr_filters": ("0", REFUSED),
    "node_rank": ("0", lambda spec: spec.node_rank == 0),
    "master_addr": ("127.0.0.2", lambda spec: True),  # used with --master-port only: see the test below
    "master_port": ("29544", lambda spec: spec.rdzv_port == 29544),
    "local_addr": ("10.0.0.1", REFUSED),
    "logs_specs": ("torchrun.logs_specs", REFUSED),
    "numa_binding": ("node", REFUSED),
    "signals_to_handle": ("SIGTERM,SIGUSR1", lambda spec: spec.stop_signals == (signal.SIGTERM, signal.SIGUSR1)),
    "shutdown_timeout": ("9", lambda spec: spec.term_grace_s == 9.0),
    "virtual_local_rank": (None, REFUSED),
}


def _torchrun_options() -> list[Any]:
    from torch.distributed.run import get_args_parser

    return [action for action in get_args_parser()._actions if action.option_strings and action.dest != "help"]


def test_every_torchrun_option_is_decided() -> None:
    found = {action.dest for action in _torchrun_options()}
    assert found - set(OPTIONS) == set(), f"torchrun options ckptd launch has not decided on: {found - set(OPTIONS)}"
    assert len(found) >= 25, found


@pytest.mark.parametrize("action", _torchrun_options(), ids=lambda action: action.dest)
def test_each_spelling_of_each_torchrun_option_is_honoured_or_refused_by_name(action: Any) -> None:
    value, check = OPTIONS[action.dest]
    for spelling in action.option_strings:
        argv = [spelling, *(() if value is None else (value,)), "train.py", "--lr", "3"]
        if check == REFUSED:
            with pytest.raises(ConfigError) as refused:
                parse_launch(argv)
            assert refused.value.exit_code == 2
            named = {name for name in action.option_strings if name.startswith("--")}
            assert any(name in str(refused.value) for name in named), (spelling, str(refused.value))
            continue
        spec = parse_launch(argv).spec
        assert check(spec), f"{spelling} {value or ''} was not honoured: {spec}"
        assert spec.command[-2:] == ("--lr", "3"), spec.command  # the script's own arguments stay its own


def test_torchrun_defaults_leave_nothing_refused_and_ckptd_keeps_its_restart_budget() -> None:
    spec = parse_launch(["train.py"]).spec
    assert (spec.nproc_per_node, spec.nnodes, spec.max_restarts, spec.preload) == (1, 1, 3, True)
    assert spec.stop_signals == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def test_master_addr_and_port_name_the_store_without_an_endpoint() -> None:
    spec = parse_launch(["--master_addr", "127.0.0.2", "--master_port", "29555", "train.py"]).spec
    assert (spec.rdzv_host, spec.rdzv_port) == ("127.0.0.2", 29555)


@pytest.mark.parametrize(("argv", "named"), [
    (["--nnodes", "1:2", "train.py"], "--nnodes"), (["--rdzv_backend", "etcd", "train.py"], "--rdzv-backend"),
    (["--rdzv-conf", "read_timeout=3", "train.py"], "--rdzv-conf"), (["--nproc-per-node", "gpu", "train.py"],
                                                                      "--nproc-per-node"),
    (["--no-python", "-m", "train"], "--no-python"), (["-r", "4", "train.py"], "--redirects"),
    (["--tee", "0:1,x", "train.py"], "--tee"), (["--local-ranks-filter", "0,one", "train.py"], "--local-ranks-filter")])
def test_values_ckptd_cannot_honour_are_refused_by_name(argv: list[str], named: str) -> None:
    pytest.importorskip("torch")
    import torch

    if named == "--nproc-per-node" and torch.cuda.is_available():
        pytest.skip("a GPU is there: gpu is a valid --nproc-per-node")
    with pytest.raises(ConfigError, match=named):
        parse_launch(argv)


def _cli(*argv: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "launch", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize(("argv", "named"), [(("--tee", "7", "train.py"), "--tee"),
                                             (("--no-such-option", "train.py"), "--no-such-option")])
def test_the_cli_exits_2_naming_the_option(argv: tuple[str, ...], named: str) -> None:
    done = _cli(*argv)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr, done.stderr
    assert "FileNotFoundError" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_job_started_with_torchrun_spellings_runs_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(\n"
                      "    os.environ['WORLD_SIZE'] + ' ' + os.environ['ROLE_NAME'] + ' ' + os.environ['LOCAL_RANK'])\n")
    done = _cli("--standalone", "--nproc_per_node=2", "--max_restarts", "0", "--role", "worker",
                "--rdzv_backend", "c10d", "--no-preload", str(script), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted((tmp_path / f"rank{rank}").read_text() for rank in range(2)) == ["2 worker 0", "2 worker 1"]


def test_the_help_imports_no_torch_yet_lists_every_torchrun_option_and_spelling() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptd.cli.main", "launch", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.splitlines()), "imported torch"
    listed = {name for line in done.stdout.splitlines() if line.startswith("  -")
              for name in line.strip().split("  ")[0].replace(",", " ").split() if name.startswith("-")}
    missing = {name for action in _torchrun_options() for name in action.option_strings} - listed
    assert not missing, f"ckptd launch --help does not list {missing}"
    assert {"--hang-timeout", "--spares", "--no-preload", "--checkpoint-on-stop"} <= listed
