"""Finding newly committed steps in the daemon's local roots.

A step is committed when ``step-*/manifest.json`` appears (linked or renamed into place). The
:class:`CommitWatcher` reports each committed step of each root to ``on_commit(root_name, step)``:

- ``mode="inotify"``: a watchdog observer (inotify on Linux) on every root sees manifests appear at once;
  a full rescan runs at start and every ``poll_interval_s * 10`` seconds for events the kernel dropped.
  The watch asks the kernel for creations and moves only (:func:`watched_events`, the inotify mask
  ``IN_CREATE | IN_MOVE``): the trainer's writes into its data files, each an ``IN_MODIFY`` on a
  recursive watch, never reach the daemon;
- ``mode="poll"``: only the rescans, every ``poll_interval_s``;
- ``mode="auto"``: inotify when watchdog is importable, else poll (the log says which).

``on_commit`` may be called more than once for one step (an event and a rescan); callers are idempotent.
It runs on the watcher's threads (``ckptd-watch-scan`` and watchdog's own), never concurrently with itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckptd.background import OwnedThread, start_thread
from ckptd.errors import ConfigError
from ckptd.format.layout import MANIFEST_NAME, parse_step_dir

log = logging.getLogger("ckptd.daemon")

#: Called with (root name, step) for every committed step found.
CommitCallback = Callable[[str, int], None]


def watched_events() -> list[type]:
    """The watchdog event classes the observer asks for: a manifest linked or renamed into place (a file
    created or moved), a step directory renamed into place. watchdog turns them into the inotify mask, so
    that the kernel does not queue the modify, open and close events of the trainer's writes."""
    from watchdog.events import DirCreatedEvent, DirMovedEvent, FileCreatedEvent, FileMovedEvent

    return [FileCreatedEvent, FileMovedEvent, DirCreatedEvent, DirMovedEvent]


def committed_in(root: Path) -> list[int]:
    """Steps of ``root`` with a manifest, ascending (temporary and pinned directories are not steps)."""
    steps = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is not None and (entry / MANIFEST_NAME).is_file():
            steps.append(step)
    return sorted(steps)


def _step_of_manifest(path: str, roots: Mapping[str, Path]) -> tuple[str, int] | None:
    manifest = Path(path)
    if manifest.name != MANIFEST_NAME:
        return None
    step = parse_step_dir(manifest.parent.name)
    if step is None:
        return None
    for name, root in roots.items():
        if manifest.parent.parent == root:
            return name, step
    return None


class CommitWatcher:
    """Reports committed steps of ``roots`` (name -> directory); see the module docstring. Call :meth:`start`
    once and :meth:`stop` at the end."""

    def __init__(self, roots: Mapping[str, Path], on_commit: CommitCallback, *, mode: str = "auto",
                 poll_interval_s: float = 1.0) -> None:
        if mode not in ("auto", "inotify", "poll"):
            raise ConfigError(f"watch must be auto, inotify or poll, got {mode!r}")
        self.roots = {name: Path(root).resolve() for name, root in roots.items()}
        self.on_commit = on_commit
        self.poll_interval_s = poll_interval_s
        self.requested_mode = mode
        #: What runs: "inotify" or "poll" (known after :meth:`start`).
        self.mode = mode
        self._stop = threading.Event()
        self._callback_lock = threading.Lock()
        self._observer: Any = None
        self._thread: OwnedThread | None = None
        #: Rescans done so far (the status document and tests read it).
        self.scans = 0

    def start(self) -> None:
        """Scan every root once (reporting what is committed now), then start watching."""
        self.mode = self._choose_mode()
        self.rescan()
        if self.mode == "inotify":
            self._start_observer()
            interval = self.poll_interval_s * 10
        else:
            interval = self.poll_interval_s
        log.info("watching %d root(s) for commits with %s (rescan every %.1fs)", len(self.roots), self.mode, interval)
        self._thread = start_thread("ckptd-watch-scan", self._scan_loop, interval)

    def _choose_mode(self) -> str:
        if self.requested_mode == "poll":
            return "poll"
        try:
            import watchdog.observers  # noqa: F401
        except ImportError as exc:
            if self.requested_mode == "inotify":
                raise ConfigError("watch = 'inotify' needs the watchdog package",
                                  hint="pip install 'ckptd[daemon]', or set watch = 'poll'") from exc
            log.info("watchdog is not installed: polling the roots for commits")
            return "poll"
        return "inotify"

    def _start_observer(self) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        watcher = self

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.is_directory:
                    if event.event_type in ("moved", "created"):  # a step directory renamed into place
                        target = str(getattr(event, "dest_path", "") or event.src_path)
                        watcher._directory_appeared(Path(target))
                    return
                if event.event_type not in ("created", "moved"):
                    return
                path = str(getattr(event, "dest_path", "") or event.src_path)
                found = _step_of_manifest(path, watcher.roots)
                if found is not None:
                    watcher._report(*found)

        observer = Observer()
        handler = _Handler()
        for root in self.roots.values():
            observer.schedule(handler, str(root), recursive=True, event_filter=watched_events())
        observer.daemon = True
        observer.start()
        self._observer = observer

    def _directory_appeared(self, directory: Path) -> None:
        for name, root in self.roots.items():
            if directory.parent == root:
                step = parse_step_dir(directory.name)
                if step is not None and (directory / MANIFEST_NAME).is_file():
                    self._report(name, step)

    def _report(self, root_name: str, step: int) -> None:
        with self._callback_lock:
            if self._stop.is_set():
                return
            try:
                self.on_commit(root_name, step)
            except Exception:  # noqa: BLE001 - a failing callback must not end the watch
                log.exception("handling the commit of step %d in root %s failed", step, root_name)

    def rescan(self) -> None:
        """Report every committed step of every root (what events may have missed)."""
        for name, root in self.roots.items():
            for step in committed_in(root):
                self._report(name, step)
        self.scans += 1

    def _scan_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.rescan()
            except Exception:  # noqa: BLE001 - the next rescan tries again
                log.exception("rescanning the roots failed")

    def stop(self) -> None:
        """Stop watching (a callback in progress finishes first)."""
        self._stop.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
        if self._thread is not None:
            if not self._thread.join_within(5):
                log.warning("the rescan thread did not stop within 5 s (a rescan is slow); it ends by itself")
            self._thread = None
