"""The uploader is killed with SIGKILL at random points of a promotion and started again: the step ends
committed exactly once (one manifest version in a versioned bucket), never committed with a chunk
missing, and chunks already stored are not uploaded again."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptd.config import override
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.stepio.step_reader import verify_step
from ckptd.promotion import Promoter, collect_garbage, stored_chunks
from ckptd.promotion.contents import read_step_contents
from test_promotion_support import object_tier, s3_client, save_local

pytestmark = pytest.mark.s3

_CHILD = """
import sys, json
from ckptd.config import override
from ckptd.promotion import Promoter
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
local = LocalTier(sys.argv[1])
remote = ObjectTier(sys.argv[2], storage_options=json.loads(sys.argv[3]))
import threading
lock = threading.Lock()
def event(name):
    with lock:
        print(name, flush=True)
with override(s3_concurrency=2, s3_part_bytes=5 * 1024 * 1024):
    event("ready")
    Promoter(local, remote, on_phase=event).promote(int(sys.argv[4]), progress=lambda size: event("chunk"))
event("done")
"""


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    state = {f"layer{index}": torch.randn(16 * 1024, generator=generator) for index in range(48)}
    state["embedding"] = torch.randn(3 * 1024 * 1024, generator=generator)  # 12 MiB: multipart chunks
    return state


def _kill_at_event(arguments: list[str], kill_after: int, chooser: random.Random) -> str:
    """Run the uploader and SIGKILL it right after (0-20 ms) the ``kill_after``-th event it reports."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *arguments], stdout=subprocess.PIPE, text=True)
    seen = []
    try:
        assert child.stdout is not None
        while len(seen) <= kill_after:
            line = child.stdout.readline().strip()
            if not line or line == "done":
                break
            seen.append(line)
        time.sleep(chooser.uniform(0.0, 0.02))
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return f"killed after {seen[-1] if seen else 'start'} (event {len(seen)})"


def test_killed_uploader_resumes_and_commits_exactly_once(tmp_path, s3_server, s3_bucket, s3_options):
    s3_client(s3_server).put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    local = save_local(tmp_path / "local", {9: _state()}, chunk_bytes=6 * 1024 * 1024)
    remote = object_tier(s3_bucket, s3_options)
    needed = set(read_step_contents(local, 9).unique_chunks())
    arguments = [str(local.root), remote.url, json.dumps(s3_options), "9"]
    chooser = random.Random(int(os.environ.get("CKPTD_TEST_SEED", "20261130")))
    outcomes = []
    events = len(needed) + 5  # ready, marked, chunks, one per chunk, verified, committed
    for low, high in ((0, 3), (3, events - 3), (events - 3, events)):
        outcomes.append(_kill_at_event(arguments, chooser.randrange(low, high), chooser))
        if remote.is_committed(9):  # never committed with a chunk missing
            assert list(verify_step(remote, 9)) == [], outcomes
    stored_before = set(stored_chunks(remote))
    with override(s3_part_bytes=5 * 1024 * 1024):
        report = Promoter(local, remote).promote(9)
    assert report.already_committed or report.chunks_uploaded == len(needed - stored_before), outcomes
    assert remote.committed_steps() == [9]
    assert list(verify_step(remote, 9)) == []
    assert set(stored_chunks(remote)) == needed, "no chunk missing, none extra"
    versions = s3_client(s3_server).list_object_versions(Bucket=s3_bucket, Prefix=f"run/{step_dir(9)}/{MANIFEST_NAME}")
    assert len(versions.get("Versions", [])) == 1, f"committed exactly once ({outcomes})"
    collect_garbage(remote, abandoned_after_s=0)
    assert remote.incomplete_uploads() == [], "multipart uploads of killed runs are aborted by GC"
    assert list(verify_step(remote, 9)) == []
