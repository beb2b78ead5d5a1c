"""WebDataset tar shards: files grouped into samples by their key (the name up to the first dot).

Sample ``i`` is a dict ``{"__key__": key, ext: bytes, ...}``, the shape ``webdataset`` yields before
decoding (``ext`` is everything after the first dot of the member's base name, as WebDataset does).
The layout stores each member's data offset and size, so reading a sample slices the shard bytes
without parsing tar headers again.

Nothing is ever extracted. Only regular files become samples (links, devices, FIFOs and directories
are skipped), and a shard with a member whose name leaves the archive (absolute, or with a ``..``
part: what PEP 706's ``data`` filter refuses) is refused, since its key would do the same in a consumer
that writes samples out by key.
"""

from __future__ import annotations

import io
import tarfile
from typing import Any

from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader, pack_offsets, unpack_offsets
from ckptd.errors import FormatError


def _check_name(member: str, shard: str) -> None:
    if member.startswith("/") or ".." in member.split("/"):
        raise FormatError(f"tar shard {shard} has a member named {member!r}, which leaves the archive",
                          path=shard, hint="rewrite the shard with relative member names inside it")


def _split_name(member: str) -> tuple[str, str]:
    directory, _, base = member.rpartition("/")
    stem, dot, extension = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, extension if dot else ""


class _OpenTar:
    def __init__(self, data: bytes, layout: ShardLayout, name: str) -> None:
        locator = layout.locator
        self._data = data
        self._keys: list[str] = list(locator["keys"])
        self._extensions: list[str] = list(locator["extensions"])
        self._offsets = unpack_offsets(locator["offsets"]).tolist()
        self._sizes = unpack_offsets(locator["sizes"]).tolist()
        self._first = unpack_offsets(locator["first_member"]).tolist() + [len(self._extensions)]
        if len(self._keys) != layout.samples or (self._offsets and max(
                o + s for o, s in zip(self._offsets, self._sizes)) > len(data)):
            raise FormatError(f"the manifest's member index does not fit tar shard {name}", path=name,
                              hint="re-index the dataset with `ckptd data index`")

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"__key__": self._keys[index]}
        for member in range(self._first[index], self._first[index + 1]):
            offset = self._offsets[member]
            sample[self._extensions[member]] = self._data[offset:offset + self._sizes[member]]
        return sample


class WebDatasetReader(ShardReader):
    """Reads WebDataset ``.tar`` shards (uncompressed tar, members of one sample adjacent)."""

    format_name = "webdataset"
    suffixes = (".tar",)

    def scan(self, data: bytes, name: str) -> ShardLayout:
        keys: list[str] = []
        extensions: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        first_member: list[int] = []
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
                for member in archive:
                    _check_name(member.name, name)
                    if not member.isfile():
                        continue
                    key, extension = _split_name(member.name)
                    if not keys or keys[-1] != key:
                        keys.append(key)
                        first_member.append(len(extensions))
                    extensions.append(extension)
                    offsets.append(member.offset_data)
                    sizes.append(member.size)
        except tarfile.TarError as exc:
            raise FormatError(f"{name} is not a readable tar file: {exc}", path=name,
                              hint="is this a WebDataset shard? pick another --format") from exc
        if len(set(keys)) != len(keys):
            raise FormatError(f"tar shard {name} splits a sample's files apart (a key appears twice)",
                              path=name, hint="write each sample's files next to each other")
        return ShardLayout(samples=len(keys), locator={
            "keys": keys, "extensions": extensions, "offsets": pack_offsets(offsets),
            "sizes": pack_offsets(sizes), "first_member": pack_offsets(first_member)})

    def open(self, data: bytes, layout: ShardLayout, name: str) -> OpenShard:
        return _OpenTar(data, layout, name)
