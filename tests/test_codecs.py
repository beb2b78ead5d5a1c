"""Codecs: every codec round-trips every stored dtype (directly and through the writer and reader);
decompression never produces more than the recorded size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard

from ckptd.config import override
from ckptd.errors import IntegrityError
from ckptd.format import codecs
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.stepio.rank_writer import RankWriter, tensor_bytes
from ckptd.format.records import DTYPES, Manifest
from ckptd.stepio.step_reader import ChunkSource, StepReader, load_step_manifest, load_rank_index
from ckptd.tiers.local import LocalTier


def _sample(dtype: torch.dtype, count: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return raw[:count] % 2 == 1
    return raw.view(dtype).reshape(count)


def _raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(tensor.contiguous()))


@pytest.mark.parametrize("codec", codecs.CHECKPOINT_CODECS)
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_codec_round_trips_every_dtype(codec: str, dtype_name: str) -> None:
    tensor = _sample(DTYPES[dtype_name])
    codec_id = codecs.codec_id_for(codec, floating=tensor.is_floating_point() or tensor.is_complex(),
                                   itemsize=tensor.element_size())
    raw = _raw(tensor)
    stored = codecs.encode(codec_id, memoryview(raw))
    assert bytes(codecs.decode(codec_id, stored, len(raw))) == raw


@pytest.mark.parametrize("codec", codecs.CHECKPOINT_CODECS)
def test_writer_and_reader_round_trip_all_dtypes_in_small_chunks(tmp_path: Path, codec: str) -> None:
    tier = LocalTier(tmp_path)
    tensors = {name: _sample(dtype, 333) for name, dtype in DTYPES.items()}
    with override(io_threads=2):
        writer = RankWriter(tier, 1, 0, codec=codec, chunk_bytes=256)
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        entry = writer.finish({"note": "codec test"})
        manifest = Manifest(step=1, world_size=1, ranks=(entry,), codec=codec)
        tier.write_bytes(step_file(1, MANIFEST_NAME), manifest.to_json_bytes())
        manifest = load_step_manifest(tier, 1)
        reader = StepReader([ChunkSource(tier, load_rank_index(tier, manifest, 0))])
        for name, tensor in tensors.items():
            assert reader.index.tensors[name].chunks, name
            assert _raw(reader.read_tensor(name)) == _raw(tensor), name


@pytest.mark.parametrize("codec_id", ["zstd", "byteplane2", "byteplane4"])
def test_a_frame_declaring_more_than_the_record_is_refused(codec_id: str) -> None:
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (8 * 1024 * 1024))
    with pytest.raises(IntegrityError, match="decompression bomb"):
        codecs.decode(codec_id, bomb, 1024)


def test_a_frame_without_declared_size_is_capped_at_the_record() -> None:
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=False)
    stream = compressor.compressobj()
    bomb = stream.compress(b"\0" * (8 * 1024 * 1024)) + stream.flush()
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(IntegrityError, match="refused beyond the recorded size"):
        codecs.decode("zstd", bomb, 4096)


def test_byteplane_groups_exponent_bytes_and_compresses_bf16_better_than_zstd() -> None:
    torch.manual_seed(0)
    weights = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16)
    raw = memoryview(_raw(weights))
    plain = len(codecs.encode("zstd", raw))
    planes = len(codecs.encode("byteplane2", raw))
    assert planes < plain < len(raw)
