"""The daemon's inotify watch asks the kernel for creations and moves only, and still sees every commit.

The mask is read back from the kernel (``/proc/self/fdinfo`` of the observer's inotify descriptor), and
the commits are made by a real CheckpointManager (the manifest linked into place) and by a step directory
renamed into place, with the periodic rescan far away so that only inotify events can report them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.daemon.watcher import CommitWatcher
from ckptd.format.layout import MANIFEST_NAME, step_dir
from harness.daemon_process import wait_until

pytest.importorskip("watchdog")

IN_MODIFY, IN_CLOSE_WRITE, IN_OPEN, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x20, 0x80, 0x100


def _inotify_masks() -> dict[tuple[str, str], int]:
    """(descriptor, watch) -> mask of every inotify watch this process holds, from the kernel."""
    masks = {}
    for info in Path("/proc/self/fdinfo").iterdir():
        try:
            text = info.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("inotify wd:"):
                fields = dict(field.split(":", 1) for field in line.split()[1:])
                masks[(info.name, fields["wd"])] = int(fields["mask"], 16)
    return masks


def test_watch_mask_leaves_out_writes_and_commits_are_seen(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    before = set(_inotify_masks())
    seen: list[int] = []
    watcher = CommitWatcher({"run1": root}, lambda name, step: seen.append(step), mode="inotify",
                            poll_interval_s=1000.0)  # rescans every 10000 s: only events report commits
    watcher.start()
    try:
        with ckptd.CheckpointManager(root, capture_rng=False, policy=ckptd.Policy(keep_local=None)) as manager:
            manager.save(1, {"weights": torch.arange(300_000, dtype=torch.float32)})
            manager.wait()
        wait_until(lambda: 1 in seen, 10, "step 1 reported from its inotify event")
        # a step directory renamed into place with its manifest already in it
        staged = tmp_path / "staged"
        staged.mkdir()
        (staged / MANIFEST_NAME).write_bytes(b"{}")
        os.rename(staged, root / step_dir(7))
        wait_until(lambda: 7 in seen, 10, "step 7 reported from its inotify event")
        ours = {key: mask for key, mask in _inotify_masks().items() if key not in before}
        assert len(ours) >= 2  # the root and the step directories below it are watched
        for mask in ours.values():
            assert mask & (IN_MODIFY | IN_CLOSE_WRITE | IN_OPEN) == 0, hex(mask)
            assert mask & IN_CREATE and mask & IN_MOVED_TO, hex(mask)
        time.sleep(0.2)
        assert sorted(set(seen)) == [1, 7]
    finally:
        watcher.stop()
