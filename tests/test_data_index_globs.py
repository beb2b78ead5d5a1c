"""``ckptd data index`` on real dataset layouts: include/exclude globs, a directory holding several
splits, a single file, and the help that documents every format option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.data import ShardDataset, ShardLoader, index_dataset, load_dataset_manifest
from ckptd.data.selection import matches, split_of
from ckptd.errors import ConfigError, NotFoundError

SEQ_LEN = 9


@pytest.fixture()
def nanogpt_dir(tmp_path: Path) -> Path:
    """nanoGPT's prepare.py layout: train.bin and val.bin side by side, uint16 tokens. Train tokens are
    below 1000, validation tokens 1000 and above, so a mix shows in the samples."""
    root = tmp_path / "shakespeare"
    root.mkdir()
    np.arange(0, 90, dtype=np.uint16).tofile(root / "train.bin")  # 10 windows
    np.arange(1000, 1045, dtype=np.uint16).tofile(root / "val.bin")  # 5 windows
    (root / "meta.pkl").write_bytes(b"not a shard")
    return root


def _index(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["data", "index", *args])
    return result.exit_code, result.output


def _tokens(manifest_path: Path, cache: Path) -> list[int]:
    loader = ShardLoader(ShardDataset(str(manifest_path), global_batch_size=1, shuffle=False, cache_dir=cache))
    return [token for batch in loader for token in batch.flatten().tolist()]


def test_a_directory_with_train_and_val_is_refused_without_a_choice(nanogpt_dir: Path, tmp_path: Path) -> None:
    code, output = _index(str(nanogpt_dir), "--format", "tokens", "--option", f"seq_len={SEQ_LEN}",
                          "--out", str(tmp_path / "m.json"))
    assert code == ConfigError.exit_code
    assert "train.bin" in output and "val.bin" in output and "--include" in output
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(ConfigError, match="several dataset splits"):
        index_dataset(str(nanogpt_dir), "tokens", reader_options={"seq_len": SEQ_LEN})


def test_include_picks_the_training_split_only(nanogpt_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    code, output = _index(str(nanogpt_dir), "--format", "tokens", "--option", f"seq_len={SEQ_LEN}",
                          "--include", "train*", "--out", str(out), "--json")
    assert code == 0, output
    summary = json.loads(output)
    assert summary["shards"] == 1 and summary["samples"] == 10
    manifest = load_dataset_manifest(out)
    assert [shard.path for shard in manifest.shards] == ["train.bin"]
    assert _tokens(out, tmp_path / "cache") == list(range(90))


def test_exclude_leaves_the_validation_split_out(nanogpt_dir: Path, tmp_path: Path) -> None:
    manifest = index_dataset(str(nanogpt_dir), "tokens", reader_options={"seq_len": SEQ_LEN},
                             exclude=("val*",)).manifest
    assert [shard.path for shard in manifest.shards] == ["train.bin"]
    validation = index_dataset(str(nanogpt_dir), "tokens", reader_options={"seq_len": SEQ_LEN},
                               include=("val.bin",)).manifest
    assert [shard.path for shard in validation.shards] == ["val.bin"] and validation.total_samples == 5


def test_a_single_file_is_indexed_alone_under_its_directory(nanogpt_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "val.json"
    code, output = _index(str(nanogpt_dir / "val.bin"), "--format", "tokens", "--option", f"seq_len={SEQ_LEN}",
                          "--out", str(out))
    assert code == 0, output
    manifest = load_dataset_manifest(out)
    assert manifest.root == str(nanogpt_dir)
    assert [shard.path for shard in manifest.shards] == ["val.bin"]
    assert _tokens(out, tmp_path / "cache") == list(range(1000, 1045))
    # indexing it again reuses the record: the root the CLI compares with is the file's directory
    code, output = _index(str(nanogpt_dir / "val.bin"), "--format", "tokens", "--option", f"seq_len={SEQ_LEN}",
                          "--out", str(out), "--json")
    assert code == 0 and json.loads(output)["reused"] == 1


def test_globs_with_a_slash_match_the_path_and_subdirectories_are_kept_apart(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    for part in ("en", "de"):
        (root / part).mkdir(parents=True)
        for shard in range(2):
            np.arange(shard * 18, shard * 18 + 18, dtype=np.uint16).tofile(root / part / f"part-{shard}.bin")
    english = index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}, include=("en/*.bin",)).manifest
    assert [shard.path for shard in english.shards] == ["en/part-0.bin", "en/part-1.bin"]
    by_name = index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}, include=("part-1.bin",)).manifest
    assert [shard.path for shard in by_name.shards] == ["de/part-1.bin", "en/part-1.bin"]
    with pytest.raises(NotFoundError, match="matching nothing-here"):
        index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}, include=("nothing-here*",))


def test_include_replaces_the_readers_file_endings(tmp_path: Path) -> None:
    root = tmp_path / "odd"
    root.mkdir()
    np.arange(18, dtype=np.uint16).tofile(root / "tokens.u16")
    with pytest.raises(NotFoundError, match="files ending in .bin, .npy"):
        index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN})
    manifest = index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}, include=("*.u16",)).manifest
    assert manifest.total_samples == 2


def test_split_names_and_glob_rules() -> None:
    assert split_of("train.bin") == "train" and split_of("val.bin") == "validation"
    assert split_of("shard-000-test.jsonl") == "test" and split_of("part-000.bin") is None
    assert split_of("trainval.bin") is None  # one word: names no split
    assert split_of("validation/part-0.parquet") == "validation" and split_of("train/val-0.bin") is None
    assert matches("a/b/train.bin", "train*") and not matches("a/b/train.bin", "a/train*")
    assert matches("a/b/train.bin", "a/*/train.bin") and matches("a/b/train.bin", "a/*")


def test_help_documents_every_format_option() -> None:
    result = CliRunner().invoke(cli, ["data", "index", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for needed in ("seq_len=N", "block_size + 1", "non-overlapping windows", "dtype=D", "uint16", "--include",
                   "--exclude", "jsonl", "webdataset", "parquet", "one file"):
        assert needed in text, needed
    listed = CliRunner().invoke(cli, ["data", "formats", "--json"])
    assert listed.exit_code == 0
    formats = {entry["format"]: entry for entry in json.loads(listed.output)}
    assert formats["tokens"]["options"] == {"seq_len": "int", "dtype": "str"}
    for name in ("tokens", "jsonl", "webdataset", "parquet"):  # every option a built-in reader takes is in the help
        for option in formats[name]["options"]:
            assert f"{option}=" in text, (name, option)
    page = (Path(__file__).resolve().parent.parent / "docs" / "data-loader.md").read_text()
    for needed in ("--include", "--exclude", "seq_len", "block_size + 1", "split_targets"):
        assert needed in page, needed


def test_indexing_does_not_import_torch() -> None:
    code = ("import sys, ckptd.cli.data_cmd, ckptd.data.indexer, ckptd.data; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from ckptd.data import ShardLoader; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
