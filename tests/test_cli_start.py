"""The CLI answers at once: ``ckptd --help``, each subcommand's ``--help`` and ``import ckptd`` import no
torch. Each runs in a fresh interpreter with ``-X importtime``, which names every module imported;
nothing here measures time (``benchmarks/bench_cli_start.py`` does)."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Subcommands whose ``--help`` must not import torch (data imports the data loader at module level).
LIGHT_COMMANDS = ("ls", "inspect", "restore", "gc", "promote", "bench", "demo", "verify", "launch")


def imported_modules(*args: str) -> tuple[set[str], str]:
    """The top-level names of every module a fresh ``python -X importtime ARGS`` imports, and its stdout."""
    completed = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True,
                               check=False, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    names = set()
    for line in completed.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "site" in names, "the import log was read"
    return names, completed.stdout


def test_the_import_log_sees_torch_when_it_is_imported() -> None:
    names, _ = imported_modules("-c", "import torch")
    assert "torch" in names


def test_ckptd_help_imports_no_torch() -> None:
    names, output = imported_modules("-m", "ckptd.cli.main", "--help")
    assert "torch" not in names
    for command in ("ls", "verify", "inspect", "restore", "gc", "promote", "bench", "data", "demo", "launch"):
        assert f"  {command} " in output, output
    assert not any(name.startswith("ckptd.cli.") and name.endswith("_cmd") for name in names), \
        "no subcommand module is imported to list the commands"


@pytest.mark.parametrize("command", LIGHT_COMMANDS)
def test_subcommand_help_imports_no_torch(command: str) -> None:
    names, output = imported_modules("-m", "ckptd.cli.main", command, "--help")
    assert "torch" not in names, f"ckptd {command} --help imported torch"
    assert f"ckptd {command}" in output


@pytest.mark.parametrize(("command", "says"), [(("ls",), "committed"), (("ls", "--verify"), "verified"),
                                              (("verify",), "all intact"), (("inspect",), "weights")])
def test_commands_that_read_a_checkpoint_directory_import_no_torch(tmp_path, command: tuple[str, ...],
                                                                   says: str) -> None:
    import torch

    import ckptd

    with ckptd.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(3, {"weights": torch.arange(70_000, dtype=torch.float32), "step": 3}, force=True)
    names, output = imported_modules("-m", "ckptd.cli.main", *command, str(tmp_path / "ckpt"))
    assert "torch" not in names, f"ckptd {' '.join(command)} DIR imported torch"
    assert says in output, output


def test_import_ckptd_imports_no_torch_until_the_manager_is_used() -> None:
    code = ("import sys, ckptd; assert 'torch' not in sys.modules; "
            "assert 'CheckpointManager' in dir(ckptd) and 'ShardLoader' in ckptd.__all__; "
            "ckptd.Policy(every_steps=2); ckptd.IntegrityError; assert 'torch' not in sys.modules; "
            "ckptd.CheckpointManager; assert 'torch' in sys.modules; print('ok')")
    _, output = imported_modules("-c", code)
    assert output.strip() == "ok"


def test_the_help_lines_are_the_commands_own() -> None:
    import click

    from ckptd.cli.main import _SUBCOMMANDS, cli

    context = click.Context(cli)
    for module_name, attribute, *help_line in _SUBCOMMANDS:
        command = cli.get_command(context, attribute)
        assert command is not None and command.name == attribute, module_name
        if help_line:
            assert help_line[0] == command.get_short_help_str(limit=500), f"update the help line of {attribute}"


def test_the_format_reads_manifests_and_indexes_without_torch(tmp_path) -> None:
    import torch

    import ckptd

    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"weights": torch.arange(6, dtype=torch.bfloat16), "step": 1}, force=True)
    step = tmp_path / "ckpt" / "step-000000000001"
    code = ("import sys, pathlib; from ckptd.format.records import Manifest, RankIndex; "
            f"step = pathlib.Path({str(step)!r}); "
            "manifest = Manifest.from_json_bytes((step / 'manifest.json').read_bytes(), path='m', step=1); "
            "index = RankIndex.from_json_bytes((step / manifest.entry(0).index_file).read_bytes(), path='i', step=1); "
            "assert 'torch' not in sys.modules; print(index.tensors['weights'].dtype, index.tensors['weights'].nbytes)")
    _, output = imported_modules("-c", code)
    assert output.split() == ["bfloat16", "12"]


def test_the_stored_dtype_sizes_are_torch_sizes() -> None:
    import torch

    from ckptd.format.records import DTYPE_ITEMSIZES, DTYPE_NAMES, DTYPES

    assert set(DTYPES) == set(DTYPE_ITEMSIZES)
    for name, size in DTYPE_ITEMSIZES.items():
        assert DTYPES[name] is getattr(torch, name) and DTYPES[name].itemsize == size, name
        assert DTYPE_NAMES[DTYPES[name]] == name
