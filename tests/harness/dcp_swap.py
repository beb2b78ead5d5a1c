"""Run PyTorch's own DCP tests with ckptd's storage plugins in place of DCP's file-system ones.

A pytest plugin: ``pytest -p harness.dcp_swap <directory of PyTorch's DCP test files>`` (or
``make test-pytorch-dcp PYTORCH_TESTS=<directory>``). When it loads, before any test module is imported,
``torch.distributed.checkpoint.FileSystemWriter``/``FileSystemReader`` (the package's names, those of
``torch.distributed.checkpoint.filesystem``, ``format_utils`` and the auto-detection that ``dcp.save``/
``dcp.load`` use for a bare ``checkpoint_id``) become :class:`SwappedWriter`/:class:`SwappedReader`:
:class:`~ckptd.dcp.CkptdStorageWriter`/:class:`~ckptd.dcp.CkptdStorageReader` taking
``FileSystemWriter``'s arguments. ``path`` is a ckptd root: each save writes its next step and a load
reads its newest committed step, so a test that saves twice to one directory and loads it gets the
last save, as with ``FileSystemWriter(overwrite=True)``; ``overwrite=False`` refuses a save to a directory
holding a committed step ("Checkpoint already exists"), as ``FileSystemWriter`` does. ``FileSystemWriter``'s options that concern its
own files (``single_file_per_rank``, ``thread_count``, ``per_thread_copy_ahead``, ``sync_files``: ckptd
always fsyncs; ``_extensions``: a ``ZStandard`` extension selects ckptd's ``zstd`` codec, others are
ignored; ``serialization_format``) are accepted and do not change what is stored.

PyTorch's multi-process test cases start their ranks with ``spawn``, and a spawned rank imports the
test module afresh: the plugin therefore also writes a ``sitecustomize`` module that swaps at start into
a temporary directory and prepends it to ``PYTHONPATH``, which the ranks inherit.

``CKPTD_DCP_SWAP=0`` loads the plugin without swapping (the same tests against DCP's own classes, to
tell a test that fails on this torch from one that fails with ckptd). The test files are PyTorch's and
are not part of ckptd: point pytest at a copy of them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from ckptd.dcp.reader import CkptdStorageReader
from ckptd.dcp.writer import CkptdStorageWriter

#: Modules whose ``FileSystemWriter``/``FileSystemReader`` names are replaced.
_MODULES = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.filesystem",
            "torch.distributed.checkpoint._storage_utils", "torch.distributed.checkpoint.format_utils")


class SwappedWriter(CkptdStorageWriter):
    """:class:`~ckptd.dcp.CkptdStorageWriter` with ``FileSystemWriter``'s constructor."""

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True,
                 _extensions: Any = None, serialization_format: Any = None, **_: Any) -> None:
        zstd = any(type(extension).__name__ == "ZStandard" for extension in _extensions or ())
        super().__init__(path, codec="zstd" if zstd else None, overwrite=overwrite)
        self.path = os.fspath(path)

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        _note("save", metadata.storage_meta.checkpoint_id)  # the writer's own may be the next save's already


class SwappedReader(CkptdStorageReader):
    """:class:`~ckptd.dcp.CkptdStorageReader` with ``FileSystemReader``'s constructor."""

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None, **_: Any) -> None:
        super().__init__(path)
        self.path = os.fspath(path)

    def read_metadata(self) -> Any:
        metadata = super().read_metadata()
        _note("load", self.checkpoint_id)
        return metadata


def _note(what: str, checkpoint_id: str | None) -> None:
    """One line per save committed / load begun through ckptd, in the swap's directory (all processes)."""
    directory = os.environ.get(_DIRECTORY_VARIABLE)
    if directory:
        with open(os.path.join(directory, "operations.log"), "a", encoding="utf-8") as handle:
            handle.write(f"{what} {os.getpid()} {checkpoint_id}\n")


def swap() -> dict[str, tuple[Any, Any]]:
    """Replace DCP's file-system writer and reader by ckptd's; returns the originals by module."""
    import importlib

    originals: dict[str, tuple[Any, Any]] = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        originals[name] = (getattr(module, "FileSystemWriter", None), getattr(module, "FileSystemReader", None))
        if hasattr(module, "FileSystemWriter"):
            module.FileSystemWriter = SwappedWriter  # type: ignore[attr-defined]
        if hasattr(module, "FileSystemReader"):
            module.FileSystemReader = SwappedReader  # type: ignore[attr-defined]
    return originals


_DIRECTORY_VARIABLE = "CKPTD_DCP_SWAP_DIR"
_SITECUSTOMIZE = "import harness.dcp_swap\nharness.dcp_swap.swap()\n"


def pytest_configure(config: Any) -> None:
    """Swap before collection, so that test modules import ckptd's classes under DCP's names, here and
    in every process started from here."""
    if os.environ.get("CKPTD_DCP_SWAP", "1") == "0":
        return
    swap()
    directory = tempfile.mkdtemp(prefix="ckptd-dcp-swap-")
    with open(os.path.join(directory, "sitecustomize.py"), "w", encoding="utf-8") as handle:
        handle.write(_SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [directory, os.environ.get("PYTHONPATH")]))
    os.environ[_DIRECTORY_VARIABLE] = directory
    print("harness.dcp_swap: FileSystemWriter/FileSystemReader are ckptd's", file=sys.stderr)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many saves and loads went through ckptd (in this process and the ranks it started)."""
    directory = os.environ.get(_DIRECTORY_VARIABLE)
    if not directory:
        return
    try:
        with open(os.path.join(directory, "operations.log"), encoding="utf-8") as handle:
            lines = handle.read().split()
    except FileNotFoundError:
        lines = []
    terminalreporter.write_line(f"harness.dcp_swap: {lines[0::3].count('save')} saves committed and "
                                f"{lines[0::3].count('load')} rank loads read through ckptd's plugins")


def pytest_report_header(config: Any) -> str:
    swapped = os.environ.get("CKPTD_DCP_SWAP", "1") != "0"
    return "dcp storage: " + ("ckptd (swapped in by harness.dcp_swap)" if swapped else "DCP's own")
