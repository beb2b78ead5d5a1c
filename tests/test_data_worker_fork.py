"""A DataLoader worker forked from a training process that holds garbage with threads behind it.

The training process here holds a real gloo process group in a reference cycle, not yet collected (as a
process that lost a generation of its group may), and collects often. A worker forked from it inherits
the garbage but not the group's threads; if the worker's collector freed the group, its destructor would
wait on those threads forever (or abort). Seen in CI as "DataLoader worker (pid N) exited unexpectedly".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = r'''
import gc, json, sys
import torch.distributed as dist
from ckptd.data import ShardDataset, ShardLoader, index_dataset
from ckptd.data.testing import write_jsonl_shards

root, workers = sys.argv[1], int(sys.argv[2])
gc.disable()
cycle = {}
cycle["self"] = cycle
store = dist.TCPStore("127.0.0.1", 0, 1, True)
cycle["group"] = dist.ProcessGroupGloo(store, 0, 1)
del store, cycle
gc.set_threshold(1, 1, 1)
write_jsonl_shards(root + "/shards", [6, 6])
manifest = index_dataset(root + "/shards", "jsonl").manifest
dataset = ShardDataset(manifest, global_batch_size=2, seed=5, cache_dir=root + "/cache")
loader = ShardLoader(dataset, num_workers=workers, worker_init_fn=lambda _: gc.enable(), with_sample_ids=True)
print(json.dumps([ids for _, ids in loader]))
'''


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_forked_beside_an_uncollected_process_group_deliver_every_batch(tmp_path: Path,
                                                                                workers: int) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)

    def batch_ids(root: Path, workers: int) -> list[list[str]]:
        # the deadline only ends a hung worker's test; a loader that works takes a few seconds
        done = subprocess.run([sys.executable, str(script), str(root), str(workers)], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    seen = batch_ids(tmp_path / "with-workers", workers)
    assert len(seen) == 6
    assert seen == batch_ids(tmp_path / "in-process", 0)
