"""Committed local steps that a restore went back past, kept in ``.set-aside/`` with a record of why.

When a restore loads an older step than the newest committed one, the newer steps are renamed into
``<root>/.set-aside/<step dir>-<time>-<id>/`` (one rename: the step stops being listed at once and every
byte is kept) so that training can save those step numbers again. Next to each such directory lies its
record, ``<same name>.json`` (:class:`SetAsideRecord`): why the step was set aside (each problem with the
file, chunk, tier and expected and actual digest when the restore found bad bytes), when, and which
step training went on from. The record is written atomically before the rename, so a set-aside
directory always has one; a record without its directory (a crash between the two) is ignored and
removed with the set-aside steps.

Set-aside steps stay visible until someone deals with them: ``ckptd ls`` lists them, ``ckptd verify``
reports them and exits non-zero, ``ckptd gc --remove-set-aside`` deletes them, and the daemon counts
them (``ckptd_steps_set_aside``).
"""

from __future__ import annotations

import calendar
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptd.errors import StorageError
from ckptd.format.layout import step_dir
from ckptd.tiers.local import fsync_directory, write_file_atomically

#: Directory in a local-tier root where committed steps that training went back past are kept.
SET_ASIDE_DIRECTORY = ".set-aside"
#: The format named in every set-aside record.
RECORD_FORMAT = "ckptd-set-aside/1"
_RECORD_SUFFIX = ".json"
_KEPT_NAME = re.compile(r"^step-(\d{12})-[0-9A-Za-z]+-[0-9a-f]+$")
#: A record is a few kilobytes; anything larger is not one.
_MAX_RECORD_BYTES = 1024 * 1024


@dataclass(frozen=True)
class SetAsideProblem:
    """One thing wrong with a set-aside step, as the restore found it on one rank."""

    error: str
    rank: int | None = None
    tier: str | None = None
    file: str | None = None
    chunk: str | None = None
    expected: str | None = None
    actual: str | None = None

    @classmethod
    def from_json(cls, value: Any) -> SetAsideProblem:
        if not isinstance(value, dict):
            return cls(str(value))

        def text(key: str) -> str | None:
            item = value.get(key)
            return None if item is None else str(item)

        rank = value.get("rank")
        return cls(str(value.get("error", "")), rank if isinstance(rank, int) else None, text("tier"),
                   text("file"), text("chunk"), text("expected"), text("actual"))

    def describe(self) -> str:
        """One line: the rank and the error (which names the tier, file, chunk and digests)."""
        return self.error if self.rank is None else f"rank {self.rank}: {self.error}"


@dataclass(frozen=True)
class SetAsideRecord:
    """Why and when one step was set aside; ``name`` is its directory relative to the root."""

    step: int
    name: str
    #: Unix time of the set-aside.
    set_aside_at: float
    reason: str
    #: The step training went on from, when a restore set it aside.
    restored_step: int | None = None
    problems: tuple[SetAsideProblem, ...] = field(default_factory=tuple)
    #: False for a directory without a record (set aside by a ckptd that kept none).
    recorded: bool = True

    @property
    def corrupt(self) -> bool:
        """Whether the restore found bad bytes in it (a digest or size that did not match)."""
        return any(problem.expected is not None or problem.actual is not None for problem in self.problems)

    def describe(self) -> str:
        """One line: why, and each problem found."""
        text = self.reason
        if self.problems:
            text = f"{text}: " + " | ".join(problem.describe() for problem in self.problems)
        return text

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        del body["recorded"]
        body["format"] = RECORD_FORMAT
        body["problems"] = [asdict(problem) for problem in self.problems]
        return body


def set_aside_step(root: Path, step: int, *, reason: str | None = None, restored_step: int | None = None,
                   problems: tuple[SetAsideProblem, ...] = (), clock: Callable[[], float] = time.time) -> str:
    """Move the directory of ``step`` to ``.set-aside/<step dir>-<time>-<id>`` after writing its record
    (see the module docstring); returns the new name relative to ``root``. StorageError names the step
    and the directory when either cannot be written."""
    target_dir = root / SET_ASIDE_DIRECTORY
    now = float(clock())
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    name = f"{SET_ASIDE_DIRECTORY}/{step_dir(step)}-{stamp}-{uuid.uuid4().hex[:6]}"
    if reason is None:
        reason = f"newer than the restored step {restored_step}" if restored_step is not None else "set aside"
    record = SetAsideRecord(step, name, now, reason, restored_step, tuple(problems))
    try:
        target_dir.mkdir(exist_ok=True)
        record_bytes = (json.dumps(record.to_json(), indent=1) + "\n").encode()
        write_file_atomically(root / f"{name}{_RECORD_SUFFIX}", record_bytes)
        os.rename(root / step_dir(step), root / name)
        fsync_directory(root)
        fsync_directory(target_dir)
    except OSError as exc:
        raise StorageError(f"cannot set step {step} aside: {exc.strerror or exc}", path=str(root / step_dir(step)),
                           step=step, tier="local", hint="check permissions of the checkpoint directory") from exc
    return name


def set_aside_steps(root: Path) -> list[SetAsideRecord]:
    """The steps set aside in the local root ``root``, oldest set-aside first (none when there is no
    ``.set-aside/``). A directory whose record is missing or unreadable is listed with
    ``recorded=False`` and the time of its name."""
    directory = root / SET_ASIDE_DIRECTORY
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise StorageError(f"cannot list the set-aside steps: {exc.strerror or exc}", path=str(directory),
                           tier="local", hint="check permissions of the checkpoint directory") from exc
    found = []
    for entry in entries:
        match = _KEPT_NAME.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        name = f"{SET_ASIDE_DIRECTORY}/{entry.name}"
        found.append(_read_record(root, name, int(match.group(1)), entry))
    return sorted(found, key=lambda record: (record.set_aside_at, record.step))


def _read_record(root: Path, name: str, step: int, entry: os.DirEntry[str]) -> SetAsideRecord:
    path = root / f"{name}{_RECORD_SUFFIX}"
    try:
        if path.stat().st_size > _MAX_RECORD_BYTES:
            raise ValueError("too large")
        body = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
            raise ValueError("not a set-aside record")
        restored = body.get("restored_step")
        problems = body.get("problems")
        return SetAsideRecord(step, name, float(body["set_aside_at"]), str(body.get("reason", "")),
                              restored if isinstance(restored, int) else None,
                              tuple(SetAsideProblem.from_json(p) for p in problems) if isinstance(problems, list)
                              else (), recorded=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = "no record of why" if isinstance(exc, FileNotFoundError) else f"its record is unreadable ({exc})"
        return SetAsideRecord(step, name, _time_of(entry), f"set aside; {why}", recorded=False)


def _time_of(entry: os.DirEntry[str]) -> float:
    stamp = entry.name.split("-")[2]
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%S")))
    except ValueError:
        return entry.stat(follow_symlinks=False).st_mtime


def remove_set_aside(root: Path, *, dry_run: bool = False) -> list[SetAsideRecord]:
    """Delete every set-aside step of ``root`` with its record (and records left without a directory);
    returns the steps removed (or that would be, with ``dry_run``)."""
    records = set_aside_steps(root)
    if dry_run:
        return records
    directory = root / SET_ASIDE_DIRECTORY
    try:
        for record in records:
            shutil.rmtree(root / record.name)
            (root / f"{record.name}{_RECORD_SUFFIX}").unlink(missing_ok=True)
        for entry in os.scandir(directory) if directory.is_dir() else ():
            stem = entry.name[:-len(_RECORD_SUFFIX)] if entry.name.endswith(_RECORD_SUFFIX) else None
            if stem is not None and _KEPT_NAME.match(stem) and not (directory / stem).exists():
                os.unlink(entry.path)  # a record whose step was never moved (a crash between the two)
        if directory.is_dir():
            fsync_directory(directory)
    except OSError as exc:
        raise StorageError(f"cannot remove the set-aside steps: {exc.strerror or exc}",
                           path=str(getattr(exc, "filename", None) or directory), tier="local",
                           hint="check permissions of the checkpoint directory") from exc
    return records


def set_aside_reason(step: int, restored: int,
                     failures: list[dict[str, Any]]) -> tuple[str, tuple[SetAsideProblem, ...]]:
    """The reason and problems recorded for ``step``, set aside after a restore of ``restored``; ``failures``
    are the restore's records of why ``step`` did not load (see ``RestoreResult.failed``)."""
    problems = tuple(SetAsideProblem.from_json({**failure, "error": failure.get("error", "")})
                     for failure in failures)
    if any(problem.expected is not None or problem.actual is not None for problem in problems):
        return f"bad bytes found by the restore, which went back to step {restored}", problems
    if problems:
        return f"the restore could not load it and went back to step {restored}", problems
    return f"newer than step {restored}, which training went back to (not intact on every rank)", ()
