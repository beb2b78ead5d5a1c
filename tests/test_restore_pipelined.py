"""A restore keeps the reads of every tensor in flight at once (not tensor by tensor), and still hands
objects only finished tensors and lets no read outlive a failed restore."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.config import override
from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.errors import ResumeMismatchError
from ckptd.stepio import step_reader
from ckptd.stepio.step_reader import StepReader
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from ckptd.tiers.direct_io import address

CHUNK = 1024 * 1024


class SlowReads:
    """Wraps the real chunk read: each takes ``delay`` longer; counts reads in flight and their peak."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
        self.real, self.delay = step_reader.read_chunk, delay
        self.lock = threading.Lock()
        self.running = self.peak = self.calls = 0
        self.spans: list[tuple[int, int, float, float]] = []  # memory from, to; time from, to
        self.overlapped, self.hold_first = threading.Event(), False
        monkeypatch.setattr(step_reader, "read_chunk", self)

    def __call__(self, source: Any, chunk: Any, out: memoryview, *, tensor: str = "?") -> None:
        with self.lock:
            self.running += 1
            self.calls += 1
            self.peak = max(self.peak, self.running)
            if self.running >= 2:
                self.overlapped.set()
            holds = self.hold_first and self.calls == 1
        started = time.monotonic()
        try:
            if holds:
                self.overlapped.wait(60)
            time.sleep(self.delay)
            self.real(source, chunk, out, tensor=tensor)
        finally:
            with self.lock:
                self.running -= 1
                self.spans.append((address(out), address(out) + len(out), started, time.monotonic()))

    def hold_the_first_read_until_another_runs(self) -> None:
        """The first read goes on only once a second one runs (or after 60 s): reads that overlap show
        however slowly they are handed out, reads run one by one fail the peak check after the 60 s."""
        self.hold_first = True

    def wait_for_each_read_to_start(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make a restore's walk go on only once the read it just started is running."""
        real = StepReader.read_tensor

        def read_tensor(reader: StepReader, name: str, out: torch.Tensor | None = None, *,
                        defer: bool = False) -> torch.Tensor:
            before = self.calls
            result = real(reader, name, out, defer=defer)
            deadline = time.monotonic() + 10
            while self.calls == before and time.monotonic() < deadline:
                time.sleep(0.001)
            return result

        monkeypatch.setattr(StepReader, "read_tensor", read_tensor)


class Holder:
    """A stateful object that keeps a copy of what its ``load_state_dict`` received."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.received: torch.Tensor | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.received = state["weight"].clone()


def single_chunk_tensors(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(CHUNK // 8, generator=generator) for i in range(count)}


def save(manager_factory: ManagerFactory, state: dict[str, Any], step: int = 1) -> None:
    manager = manager_factory()
    with override(chunk_bytes=CHUNK):
        manager.save(step, state, force=True)
        manager.wait()
    manager.close()


def test_reads_of_different_tensors_run_at_the_same_time(manager_factory: ManagerFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    saved = single_chunk_tensors(8, seed=1)
    save(manager_factory, saved)
    live = {name: torch.zeros_like(tensor) for name, tensor in saved.items()}
    slow = SlowReads(monkeypatch, delay=0.05)
    slow.hold_the_first_read_until_another_runs()
    with override(read_threads=4):
        assert manager_factory().restore(live) == 1
    assert_same_state(live, saved)
    assert slow.calls == 8
    assert slow.peak >= 2, "each tensor here is one chunk: only reads of different tensors can overlap"


def test_an_object_receives_its_tensors_only_after_their_reads_finished(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(3 * CHUNK // 4 + 5, generator=torch.Generator().manual_seed(2))
    save(manager_factory, {"holder": Holder(weight.clone()), "after": torch.arange(10.0)})
    holder = Holder(torch.zeros_like(weight))
    live: dict[str, Any] = {"holder": holder, "after": torch.zeros(10)}
    SlowReads(monkeypatch, delay=0.2)
    assert manager_factory().restore(live) == 1
    assert holder.received is not None and torch.equal(holder.received, weight)
    assert torch.equal(holder.weight, weight) and torch.equal(live["after"], torch.arange(10.0))


def test_a_restore_that_fails_midway_returns_after_every_read_stopped(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {**single_chunk_tensors(4, seed=3), "wrong_shape": torch.ones(4)}
    save(manager_factory, saved)
    live = {**{name: torch.zeros_like(t) for name, t in saved.items()}, "wrong_shape": torch.zeros(5)}
    slow = SlowReads(monkeypatch, delay=0.3)
    slow.wait_for_each_read_to_start(monkeypatch)
    restorer = manager_factory()
    with pytest.raises(ResumeMismatchError, match="wrong_shape"):
        restorer.restore(live)
    assert slow.calls >= 1 and slow.running == 0, "a read still running would write into live tensors later"
    live["wrong_shape"] = torch.zeros(4)
    assert restorer.restore(live) == 1
    assert_same_state(live, saved)  # the failed attempt lost nothing


def test_an_interrupt_while_waiting_for_reads_returns_after_every_read_stopped(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = single_chunk_tensors(4, seed=7)
    save(manager_factory, saved)
    slow = SlowReads(monkeypatch, delay=0.3)
    slow.wait_for_each_read_to_start(monkeypatch)
    real_wait, interrupted = step_reader.wait, []

    def interrupted_once(*args: Any, **kwargs: Any) -> Any:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(step_reader, "wait", interrupted_once)
    live = {name: torch.zeros_like(t) for name, t in saved.items()}
    restorer = manager_factory()
    with override(read_threads=4), pytest.raises(KeyboardInterrupt):
        restorer.restore(live)
    assert interrupted and slow.calls >= 1 and slow.running == 0, "no read may outlive the interrupt"
    assert restorer.restore(live) == 1
    assert_same_state(live, saved)  # the interrupted attempt lost nothing


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 2048)
        self.head = torch.nn.Linear(2048, 128, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_never_read_into_their_shared_memory_twice_at_once(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(8)
    model = TiedModel()
    save(manager_factory, {"model": model})
    expected = model.embed.weight.detach().clone()
    torch.manual_seed(9)
    fresh = TiedModel()
    slow = SlowReads(monkeypatch, delay=0.2)
    assert manager_factory().restore({"model": fresh}) == 1
    assert torch.equal(fresh.embed.weight, expected) and fresh.head.weight is fresh.embed.weight
    for i, (low, high, start, end) in enumerate(slow.spans):
        for other_low, other_high, other_start, other_end in slow.spans[i + 1:]:
            same_memory = low < other_high and other_low < high
            assert not (same_memory and start < other_end and other_start < end), \
                "two reads wrote and hashed the same memory at the same time"


def test_saved_bytes_survive_the_pipelined_restore_of_a_model_and_optimizer(
        manager_factory: ManagerFactory, checkpoint_dir: Path) -> None:
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 300))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    save(manager_factory, {"model": model, "optim": optimizer})
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}}
    torch.manual_seed(5)
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 300))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert manager_factory(checkpoint_dir).restore({"model": fresh, "optim": fresh_optimizer}) == 1
    assert_same_state(dict(fresh.state_dict()), expected["model"])
    assert_same_state(fresh_optimizer.state_dict()["state"], expected["optim"])


@pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")
def test_dcp_load_through_ckptd_overlaps_reads_and_waits_for_all_before_failing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = single_chunk_tensors(8, seed=6)
    with override(chunk_bytes=CHUNK):
        dcp.save(saved, storage_writer=CkptdStorageWriter(tmp_path, step=1))
    live = {name: torch.zeros_like(tensor) for name, tensor in saved.items()}
    slow = SlowReads(monkeypatch, delay=0.05)
    slow.hold_the_first_read_until_another_runs()
    with override(read_threads=4):
        dcp.load(live, storage_reader=CkptdStorageReader(tmp_path, step=1))
    assert_same_state(live, saved)
    assert slow.peak >= 2

    # the last tensor is read while the others are still arriving (a float64 target: read, then cast)
    path, offset, _ = tamper.chunk_location(tmp_path, 1, "t7")
    tamper.flip_bit(path, offset)
    live["t7"] = torch.zeros(saved["t7"].shape, dtype=torch.float64)
    slow.delay = 0.3
    with override(read_threads=4), pytest.raises(CheckpointException, match=r"'t7' at offset \d+ fails its digest"):
        dcp.load(live, storage_reader=CkptdStorageReader(tmp_path, step=1))
    assert slow.running == 0, "a read still running would write into live tensors later"


def test_disjoint_spans_find_every_overlap() -> None:
    spans, kept = step_reader._DisjointSpans(), []
    generator = torch.Generator().manual_seed(10)
    for _ in range(2000):
        start = int(torch.randint(0, 50_000, (1,), generator=generator))
        end = start + int(torch.randint(1, 60, (1,), generator=generator))
        expected = any(low < end and start < high for low, high in kept)
        assert spans.overlaps(start, end) == expected, (start, end)
        if not expected:
            spans.add(start, end)
            kept.append((start, end))
    assert len(kept) > 500
    spans.clear()
    assert not spans.overlaps(*kept[0])
