"""Shard-reader plugins: each reads back what its format's usual writer wrote; the registry's errors."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ckptd.data import ShardDataset, ShardLayout, ShardLoader, index_dataset
from ckptd.data import registry
from ckptd.data.collate import list_batch
from ckptd.errors import ConfigError, FormatError, PluginError


def _read_all(directory: Path, fmt: str, tmp_path: Path, **options: Any) -> list[Any]:
    """Index ``directory`` and read every sample in manifest order (no shuffle) through the loader."""
    manifest = index_dataset(str(directory), fmt, reader_options=options).manifest
    dataset = ShardDataset(manifest, global_batch_size=1, shuffle=False, cache_dir=tmp_path / "cache",
                           collate_fn=list_batch)
    return [batch[0] for batch in ShardLoader(dataset)]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    records = [{"id": i, "text": f"line {i} \u00e9", "nested": {"v": [i, i * 2]}} for i in range(25)]
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "a.jsonl", "w", encoding="utf-8") as handle:
        for record in records[:10]:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.write("\n")  # a blank line is not a sample
    (tmp_path / "data" / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records[10:]), encoding="utf-8")
    assert _read_all(tmp_path / "data", "jsonl", tmp_path) == records


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_arrays_round_trip(tmp_path: Path, suffix: str) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=10 * 16 + 5, dtype=np.uint16)  # 5 trailing tokens are unused
    (tmp_path / "data").mkdir()
    if suffix == ".bin":  # nanoGPT's train.bin: raw uint16 written with ndarray.tofile
        tokens.tofile(tmp_path / "data" / "train.bin")
    else:
        np.save(tmp_path / "data" / "train.npy", tokens.astype(np.int32))
    samples = _read_all(tmp_path / "data", "tokens", tmp_path, seq_len=16)
    assert len(samples) == 10
    for i, sample in enumerate(samples):
        np.testing.assert_array_equal(sample, tokens[i * 16:(i + 1) * 16])


def test_tokens_reader_needs_seq_len() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        registry.make_reader("tokens")


def test_webdataset_round_trip_against_webdataset_library(tmp_path: Path) -> None:
    webdataset = pytest.importorskip("webdataset")
    (tmp_path / "data").mkdir()
    written = []
    for shard in range(2):
        with webdataset.TarWriter(str(tmp_path / "data" / f"shard-{shard}.tar")) as sink:
            for i in range(7):
                sample = {"__key__": f"sample{shard}{i:03d}", "txt": f"caption {shard}/{i}".encode(),
                          "cls": str(i % 3).encode(), "seg.png": bytes(range(i * 5 % 256))}
                sink.write(sample)
                written.append(sample)
    ours = _read_all(tmp_path / "data", "webdataset", tmp_path)
    theirs = list(webdataset.WebDataset([str(p) for p in sorted((tmp_path / "data").glob("*.tar"))],
                                        shardshuffle=False))
    assert len(ours) == len(theirs) == len(written) == 14
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in written]
    for mine, reference in zip(ours, theirs):
        assert mine == {k: v for k, v in reference.items() if k in ("__key__", "txt", "cls", "seg.png")}


def test_parquet_round_trip_across_row_groups(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    table = pa.table({"id": list(range(30)), "text": [f"row {i}" for i in range(30)],
                      "score": [i / 7 for i in range(30)]})
    pq.write_table(table, tmp_path / "data" / "part-0.parquet", row_group_size=8)
    manifest = index_dataset(str(tmp_path / "data"), "parquet").manifest
    assert manifest.shards[0].layout["row_groups"] == [8, 8, 8, 6]
    assert _read_all(tmp_path / "data", "parquet", tmp_path) == table.to_pylist()


def test_shuffled_parquet_reads_every_row_once(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for part in range(3):
        pq.write_table(pa.table({"id": [part * 100 + i for i in range(20)]}),
                       tmp_path / "data" / f"part-{part}.parquet", row_group_size=6)
    manifest = index_dataset(str(tmp_path / "data"), "parquet").manifest
    dataset = ShardDataset(manifest, global_batch_size=4, seed=3, cache_dir=tmp_path / "cache")
    seen = [row_id for batch in ShardLoader(dataset) for row_id in batch["id"].tolist()]
    assert sorted(seen) == [p * 100 + i for p in range(3) for i in range(20)]
    assert seen != sorted(seen)


def test_malformed_shard_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(FormatError, match="bad.parquet"):
        index_dataset(str(tmp_path / "data"), "parquet")


def test_reader_rejects_a_layout_that_does_not_fit(tmp_path: Path) -> None:
    reader = registry.make_reader("jsonl")
    layout = reader.scan(b'{"a": 1}\n{"a": 2}\n', "x.jsonl")
    with pytest.raises(FormatError, match="x.jsonl"):
        reader.open(b'{"a": 1}\n', ShardLayout(layout.samples, layout.locator), "x.jsonl")


def test_unknown_format_lists_the_known_ones() -> None:
    with pytest.raises(PluginError) as caught:
        registry.reader_class("no-such-format")
    assert "jsonl" in str(caught.value) and "ckptd.shard_readers" in str(caught.value)


def test_entry_points_are_loaded_lazily_with_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = metadata.EntryPoint(name="parquet", value="ckptd_no_such_module.reader:Reader",
                                 group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: {"parquet": broken})
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(PluginError) as caught:
        registry.reader_class("parquet")
    assert "ckptd[data]" in str(caught.value) and "ckptd_no_such_module" in str(caught.value)


def test_builtin_readers_are_declared_as_entry_points() -> None:
    declared = {entry.name for entry in metadata.entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert {"jsonl", "tokens", "webdataset", "parquet"} <= declared
