"""Findings of the fault matrix's archive row (34), kept as regression tests: a WebDataset tar shard whose
member names leave the archive (``../``, absolute) is refused when it is indexed, naming the shard and the
member (such members became samples keyed ``../escape``, which a consumer writing samples out by key
would place outside its directory); links, devices and directories are never samples."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from ckptd.data import ShardDataset, ShardLoader, index_dataset
from ckptd.errors import FormatError


def _tar(path: Path, members: list[tuple[str, bytes, bytes]]) -> None:
    """Write a tar of (name, type, data) members (a link's data is its target)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            else:
                info.linkname = data.decode()
                archive.addfile(info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())


SAMPLES = [(f"s{i}.txt", tarfile.REGTYPE, f"sample {i}".encode()) for i in range(3)]


@pytest.mark.parametrize("name", ["../escape.txt", "../../escape.txt", "a/../../up.txt", "/tmp/absolute.txt",
                                  "ok/../../../etc/x.txt"])
def test_a_member_name_leaving_the_archive_is_refused(tmp_path: Path, name: str) -> None:
    # matrix row 34, seeds 3400000, 3400002, 3400009, 3400010
    _tar(tmp_path / "data" / "shard-000.tar", [*SAMPLES[:2], (name, tarfile.REGTYPE, b"x"), SAMPLES[2]])
    with pytest.raises(FormatError) as caught:
        index_dataset(str(tmp_path / "data"), "webdataset")
    assert "shard-000.tar" in str(caught.value) and repr(name) in str(caught.value), str(caught.value)
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "up.txt").exists()


def test_links_devices_and_directories_are_never_samples(tmp_path: Path) -> None:
    _tar(tmp_path / "data" / "shard-000.tar", [
        SAMPLES[0], ("link.txt", tarfile.SYMTYPE, b"/etc/passwd"), ("hard.txt", tarfile.LNKTYPE, b"s0.txt"),
        ("dev.null", tarfile.CHRTYPE, b""), ("pipe.fifo", tarfile.FIFOTYPE, b""), ("dir", tarfile.DIRTYPE, b""),
        *SAMPLES[1:]])
    manifest = index_dataset(str(tmp_path / "data"), "webdataset").manifest
    loader = ShardLoader(ShardDataset(manifest, seed=0, cache_dir=tmp_path / "cache", global_batch_size=1,
                                      shuffle=False))
    samples = [(batch["__key__"][0], batch["txt"][0]) for batch in loader]
    assert samples == [(f"s{i}", f"sample {i}".encode()) for i in range(3)]
