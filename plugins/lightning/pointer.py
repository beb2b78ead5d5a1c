"""The small file Lightning sees at each checkpoint path: which ckptd step holds that checkpoint.

Lightning names a file per checkpoint (``epoch=1-step=40.ckpt``, ``last.ckpt``), lists them to resolve
``ckpt_path="last"`` and deletes them for ``save_top_k``. The state itself lives in ckptd's tiers; the
file at that path is a pointer: a JSON object naming the format, the ckptd step and, for people reading
it, the tiers and Lightning's counters. It is written atomically (temporary name, fsync, rename) so a
crash leaves the old pointer or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from ckptd.errors import FormatError, NotFoundError

POINTER_FORMAT = "ckptd-lightning-pointer/1"
#: A pointer is a few hundred bytes; anything much larger is not one (a torch checkpoint, say).
_MAX_POINTER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Pointer:
    """What a checkpoint path points to: ckptd ``step`` (Lightning's ``global_step``) in the tiers named."""

    step: int
    epoch: int | None = None
    local: str | None = None
    remote: str | None = None
    #: ``"checkpoint"`` (a trainer checkpoint in the plugin's tiers) or ``"state"`` (a plain state dict, such as
    #: the weights ``ddp_spawn`` hands back to the main process, kept in its own root ``local``).
    kind: str = "checkpoint"

    def to_json(self) -> dict[str, Any]:
        return {"format": POINTER_FORMAT, "step": self.step, "epoch": self.epoch, "local": self.local,
                "remote": self.remote, "kind": self.kind}


def _filesystem(path: str | os.PathLike[str]) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(str(path))


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write ``pointer`` at ``path`` (creating its directory); atomic on a local file system."""
    body = (json.dumps(pointer.to_json(), indent=1) + "\n").encode()
    fs, where = _filesystem(path)
    if not _is_local(fs):
        fs.pipe_file(where, body)
        return
    target = Path(where)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_pointer(path: str | os.PathLike[str]) -> Pointer:
    """The pointer at ``path``; NotFoundError when there is no file, FormatError when it is not a pointer."""
    fs, where = _filesystem(path)
    try:
        size = fs.size(where)
        if size is not None and size > _MAX_POINTER_BYTES:
            raise FormatError(f"{path} is not a ckptd checkpoint pointer ({size} bytes)", path=str(path),
                              hint="it was written by another CheckpointIO: load it without CkptdCheckpointIO")
        raw = fs.cat_file(where)
    except FileNotFoundError as exc:
        raise NotFoundError("no Lightning checkpoint at this path", path=str(path),
                            hint="pass a path that ModelCheckpoint saved through CkptdCheckpointIO, or "
                                 "ckpt_path='last'") from exc
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path} is not a ckptd checkpoint pointer", path=str(path),
                          hint="it was written by another CheckpointIO: load it without CkptdCheckpointIO") from exc
    step = body.get("step") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != POINTER_FORMAT or not isinstance(step, int) \
            or isinstance(step, bool) or step < 0:
        raise FormatError(f"{path} is not a ckptd checkpoint pointer (format {POINTER_FORMAT})", path=str(path),
                          hint="it was written by another CheckpointIO or a newer ckptd")
    epoch = body.get("epoch")
    return Pointer(step=step, epoch=epoch if isinstance(epoch, int) else None,
                   local=body.get("local") if isinstance(body.get("local"), str) else None,
                   remote=body.get("remote") if isinstance(body.get("remote"), str) else None,
                   kind="state" if body.get("kind") == "state" else "checkpoint")


def remove_pointer(path: str | os.PathLike[str]) -> bool:
    """Delete the pointer at ``path``; returns whether there was one."""
    fs, where = _filesystem(path)
    try:
        fs.rm_file(where)
    except FileNotFoundError:
        return False
    return True


def pointers_beside(path: str | os.PathLike[str]) -> list[tuple[str, Pointer]]:
    """The pointers in the directory of ``path`` (``path`` itself included when it is one), each with its
    path written as ``path`` is (a local path, or a URL with the same protocol). Files that are not pointers
    and a directory that does not exist yield nothing."""
    fs, where = _filesystem(path)
    text = os.fspath(path)
    try:
        names = fs.ls(fs._parent(where), detail=False)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if os.path.basename(name).startswith("."):  # temporary files of write_pointer
            continue
        shown = fs.unstrip_protocol(name) if "://" in text else name
        try:
            found.append((shown, read_pointer(shown)))
        except (FormatError, NotFoundError, IsADirectoryError):
            continue
    return found
