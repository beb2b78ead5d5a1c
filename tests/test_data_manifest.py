"""Dataset manifests and the indexer: records, identity, validation, incremental re-indexing, the
``ckptd data index`` command, and indexing a prefix on moto's S3 server."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.data import DatasetManifest, index_dataset, load_dataset_manifest, save_dataset_manifest
from ckptd.data.testing import write_jsonl_shards
from ckptd.errors import FormatError, FormatVersionError, NotFoundError, UnsafePathError
from ckptd.format.hashing import shard_digest

SIZES = [5, 8, 3, 6]


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_jsonl_shards(tmp_path / "data", SIZES)
    (tmp_path / "data" / "README.txt").write_text("not a shard")
    return tmp_path / "data"


def test_index_records_every_shard(dataset_dir: Path) -> None:
    manifest = index_dataset(str(dataset_dir), "jsonl", threads=3).manifest
    assert [s.path for s in manifest.shards] == [f"shard-{i:03d}.jsonl" for i in range(4)]
    for shard, count in zip(manifest.shards, SIZES):
        data = (dataset_dir / shard.path).read_bytes()
        assert (shard.size, shard.digest, shard.samples) == (len(data), shard_digest(data), count)
        assert shard.source_version.startswith("mtime:")
    assert manifest.total_samples == sum(SIZES)


def test_manifest_round_trip_and_identity(dataset_dir: Path, tmp_path: Path) -> None:
    manifest = index_dataset(str(dataset_dir), "jsonl").manifest
    save_dataset_manifest(manifest, tmp_path / "m.json")
    loaded = load_dataset_manifest(tmp_path / "m.json")
    assert loaded == manifest and loaded.digest == manifest.digest
    assert manifest.with_root("s3://elsewhere/data").digest == manifest.digest
    assert index_dataset(str(dataset_dir), "jsonl").manifest.digest == manifest.digest
    (dataset_dir / "extra.ndjson").write_text('{"id": "x"}\n')
    assert index_dataset(str(dataset_dir), "jsonl").manifest.digest != manifest.digest


def _edit(path: Path, change: Any) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def test_damaged_manifests_are_refused(dataset_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    save_dataset_manifest(index_dataset(str(dataset_dir), "jsonl").manifest, target)
    _edit(target, lambda raw: raw["shards"][0].update(samples=99))
    with pytest.raises(FormatError, match="recorded digest"):
        load_dataset_manifest(target)
    _edit(target, lambda raw: raw["shards"][0].update(path="../../etc/passwd"))
    with pytest.raises(UnsafePathError, match="etc/passwd"):
        load_dataset_manifest(target)
    _edit(target, lambda raw: raw.update(version=99))
    with pytest.raises(FormatVersionError, match="99"):
        load_dataset_manifest(target)
    target.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_dataset_manifest(target)
    with pytest.raises(NotFoundError, match="ckptd data index"):
        load_dataset_manifest(tmp_path / "absent.json")


def test_reindex_only_rehashes_changed_shards(dataset_dir: Path) -> None:
    first = index_dataset(str(dataset_dir), "jsonl").manifest
    write_jsonl_shards(dataset_dir / "tmp", [9])
    (dataset_dir / "tmp" / "shard-000.jsonl").replace(dataset_dir / "shard-001.jsonl")  # changed content
    (dataset_dir / "shard-003.jsonl").unlink()
    (dataset_dir / "new.jsonl").write_text('{"id": "n"}\n')
    result = index_dataset(str(dataset_dir), "jsonl", previous=first)
    assert result.hashed == ("new.jsonl", "shard-001.jsonl")
    assert result.reused == ("shard-000.jsonl", "shard-002.jsonl")
    assert result.dropped == ("shard-003.jsonl",)
    by_path = {s.path: s for s in result.manifest.shards}
    assert by_path["shard-001.jsonl"].samples == 9
    assert by_path["shard-000.jsonl"] == first.shards[0]
    unchanged = index_dataset(str(dataset_dir), "jsonl", previous=result.manifest)
    assert unchanged.hashed == () and unchanged.manifest.digest == result.manifest.digest


def test_cli_index_then_reindex(dataset_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "manifest.json"
    runner = CliRunner()
    first = runner.invoke(cli, ["data", "index", str(dataset_dir), "--format", "jsonl", "--out", str(out),
                                "--threads", "2"])
    assert first.exit_code == 0, first.output
    assert "4 shard(s), 22 samples" in first.output
    assert load_dataset_manifest(out).root == os.path.abspath(dataset_dir)
    (dataset_dir / "shard-002.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    second = runner.invoke(cli, ["data", "index", str(dataset_dir), "--format", "jsonl", "--out", str(out),
                                 "--json"])
    assert second.exit_code == 0, second.output
    summary = json.loads(second.output)
    assert (summary["hashed"], summary["reused"], summary["samples"]) == (1, 3, 21)
    assert summary["manifest_digest"] == load_dataset_manifest(out).digest


def test_cli_errors_are_one_line_with_exit_codes(dataset_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    unknown = runner.invoke(cli, ["data", "index", str(dataset_dir), "--format", "csv", "--out",
                                  str(tmp_path / "m.json")])
    assert unknown.exit_code == 2 and "unknown shard format 'csv'" in unknown.output
    empty = runner.invoke(cli, ["data", "index", str(dataset_dir), "--format", "parquet", "--out",
                                str(tmp_path / "m.json")])
    assert empty.exit_code == 8 and "no parquet shards" in empty.output
    assert len(empty.output.strip().splitlines()) == 1


@pytest.mark.s3
def test_cli_indexes_an_object_store_prefix(dataset_dir: Path, tmp_path: Path, s3_bucket: str,
                                            s3_options: dict[str, Any]) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options)
    for path in sorted(dataset_dir.glob("*.jsonl")):
        fs.pipe_file(f"{s3_bucket}/corpus/train/{path.name}", path.read_bytes())
    out = tmp_path / "s3-manifest.json"
    endpoint = s3_options["client_kwargs"]["endpoint_url"]
    args = ["data", "index", f"s3://{s3_bucket}/corpus/train", "--format", "jsonl", "--out", str(out),
            "--endpoint-url", endpoint, "--storage-option", "key=testing", "--storage-option", "secret=testing",
            "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    manifest = load_dataset_manifest(out)
    local = index_dataset(str(dataset_dir), "jsonl").manifest
    assert manifest.root == f"s3://{s3_bucket}/corpus/train"
    assert [s.identity() for s in manifest.shards] == [s.identity() for s in local.shards]
    assert all(s.source_version.startswith("ETag:") for s in manifest.shards)
    again = json.loads(CliRunner().invoke(cli, args).output)
    assert (again["hashed"], again["reused"]) == (0, 4)


def test_manifest_json_is_the_documented_shape(dataset_dir: Path, tmp_path: Path) -> None:
    save_dataset_manifest(index_dataset(str(dataset_dir), "jsonl").manifest, tmp_path / "m.json")
    raw = json.loads((tmp_path / "m.json").read_text())
    assert raw["kind"] == "ckptd-dataset-manifest" and raw["version"] == 1
    assert raw["digest_algorithm"] == "xxh3-64" and raw["total_samples"] == sum(SIZES)
    assert set(raw["shards"][0]) == {"path", "size", "digest", "samples", "layout", "source_version"}
    assert DatasetManifest.from_json(raw).digest == raw["manifest_digest"]
