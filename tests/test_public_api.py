"""Public API edges: curated names, one home for the errors, keyword-only force, unknown codecs, and
remote_every_steps=None promoting every saved step (against moto's S3 server)."""

from __future__ import annotations

import inspect

import pytest
import torch

import ckptd
import ckptd.data
import ckptd.errors
from ckptd.dcp import CkptdStorageWriter
from ckptd.format import codecs


def _error_classes(module: object) -> dict[str, type]:
    return {name: value for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, ckptd.errors.CkptdError)}


def test_every_name_in_all_exists_and_is_documented():
    for name in ckptd.__all__:
        value = getattr(ckptd, name)
        if name != "__version__":
            assert inspect.getdoc(value), f"ckptd.{name} has no docstring"
    assert len(set(ckptd.__all__)) == len(ckptd.__all__), "a name is listed twice"


def test_the_public_error_classes_are_the_ones_in_ckptd_errors():
    exported = _error_classes(ckptd)
    assert set(exported) == {name for name in ckptd.__all__ if name in exported}, "every exported error is in __all__"
    homes = _error_classes(ckptd.errors)
    for name, cls in exported.items():
        assert homes[name] is cls, f"ckptd.{name} is not ckptd.errors.{name}"
        assert cls.__module__ == "ckptd.errors"
    for name in ("CkptdError", "ConfigError", "IntegrityError", "NoIntactCheckpointError", "CommitError",
                 "StorageError", "FormatVersionError", "WorkerError", "PickleRefusedError"):
        assert name in exported, f"{name} is not re-exported by ckptd"


def test_the_two_manifest_loaders_have_telling_names():
    from ckptd.stepio import step_reader
    assert ckptd.load_dataset_manifest is ckptd.data.load_dataset_manifest
    assert ckptd.save_dataset_manifest is ckptd.data.save_dataset_manifest
    assert callable(step_reader.load_step_manifest)
    for module in (ckptd, ckptd.data, step_reader):
        assert not hasattr(module, "load_manifest"), f"{module.__name__} still has an ambiguous load_manifest"


def test_force_is_keyword_only(tmp_path):
    parameter = inspect.signature(ckptd.CheckpointManager.save).parameters["force"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is False
    state = {"weights": torch.arange(4, dtype=torch.float32)}
    with ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(every_steps=10), capture_rng=False) as manager:
        with pytest.raises(TypeError):
            manager.save(3, state, True)  # type: ignore[misc]
        assert manager.save(3, state) is False
        assert manager.save(3, state, force=True) is True
        manager.wait()
        assert manager.committed_steps() == [3]


@pytest.mark.parametrize("build", ["manager", "dcp-writer"])
def test_unknown_codec_argument_is_a_config_error(tmp_path, build):
    with pytest.raises(ckptd.ConfigError) as caught:
        if build == "manager":
            ckptd.CheckpointManager(tmp_path, codec="zstandard", capture_rng=False)
        else:
            CkptdStorageWriter(tmp_path, 1, codec="zstandard")
    text = str(caught.value)
    assert "'zstandard'" in text and "from codec" in text
    assert all(known in text for known in codecs.CHECKPOINT_CODECS), text
    assert not (tmp_path / "step-00000001").exists()


@pytest.mark.parametrize("build", ["manager", "dcp-writer"])
def test_unknown_codec_in_the_environment_is_a_config_error_naming_the_variable(tmp_path, monkeypatch, build):
    monkeypatch.setenv("CKPTD_CODEC", "lz4")
    with pytest.raises(ckptd.ConfigError) as caught:
        if build == "manager":
            ckptd.CheckpointManager(tmp_path, capture_rng=False)
        else:
            CkptdStorageWriter(tmp_path, 1)
    assert "'lz4'" in str(caught.value) and "CKPTD_CODEC" in str(caught.value)
    assert caught.value.exit_code == ckptd.ConfigError.exit_code


def test_a_known_codec_from_the_environment_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTD_CODEC", "zstd")
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        assert manager.codec == "zstd"
    assert codecs.chosen_codec("byteplane") == "byteplane"


@pytest.mark.s3
def test_remote_every_steps_none_promotes_every_saved_step(tmp_path, s3_bucket, s3_options):
    policy = ckptd.Policy(every_steps=2, keep_local=None)
    state = {"weights": torch.arange(64, dtype=torch.float32)}
    with ckptd.CheckpointManager(tmp_path, remote=f"s3://{s3_bucket}/run", storage_options=s3_options,
                                 policy=policy, capture_rng=False) as manager:
        for step in range(1, 7):
            state["weights"].add_(1.0)
            manager.save(step, state)
            manager.wait_uploads()  # uploaded before the next save: a newer step supersedes queued ones
        manager.save(7, state, force=True)
        manager.wait_uploads()
        assert manager.committed_steps() == [2, 4, 6, 7]
        assert manager.remote.committed_steps() == [2, 4, 6, 7]


#: Error classes defined outside ckptd.errors on purpose: internal signals that never reach a caller.
INTERNAL_SIGNALS = {"ckptd/manager/commit.py": {"SkippedStep"},  # caught by the saver (back-pressure)
                    "ckptd/elastic/worker.py": {"_StartAfresh"}}  # caught by run(): every rank starts afresh


def test_error_classes_are_defined_in_ckptd_errors_only():
    import ast
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    names = set(_error_classes(ckptd.errors))
    stray = []
    for path in sorted([*(repo / "ckptd").rglob("*.py"), *(repo / "plugins").rglob("*.py")]):
        relative = path.relative_to(repo).as_posix()
        if relative == "ckptd/errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}
                if bases & (names | {"Exception"}) and node.name not in INTERNAL_SIGNALS.get(relative, set()):
                    stray.append(f"{relative}:{node.lineno} class {node.name}")
    assert not stray, f"error classes outside ckptd.errors (move them there): {stray}"
