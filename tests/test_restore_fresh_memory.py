"""A restore into memory that was never written (``torch.empty``, an optimizer's state at job start,
tensors ckptd allocates) returns the saved bytes, with the destination pages pre-faulted by the reader
threads, and just the same where the kernel refuses to pre-fault."""

from __future__ import annotations

import ctypes
import errno
import mmap
import pickle
import platform
import threading
from typing import Any

import numpy as np
import pytest
import torch

from ckptd.config import override
from ckptd.stepio import step_reader
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from ckptd.tiers import direct_io

PAGE = mmap.PAGESIZE
CHUNK = 1024 * 1024


def kernel_populates() -> bool:
    """Whether this kernel knows MADV_POPULATE_WRITE (Linux 5.14 and later)."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


def resident_pages(start: int, length: int) -> list[bool]:
    """Which pages of a page-aligned range are mapped (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-length // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, length, vector) == 0, ctypes.get_errno()
    return [bool(byte & 1) for byte in vector]


def fresh_pages(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    pages = mmap.mmap(-1, nbytes)
    return pages, torch.frombuffer(pages, dtype=torch.uint8)


class CountingPrefault:
    """Wraps the real ``prefault`` in the reader: counts calls and how many the kernel did."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real, self.calls, self.populated = direct_io.prefault, 0, 0
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        monkeypatch.setattr(step_reader, "prefault", self)

    def __call__(self, start: int, length: int) -> bool:
        done = self.real(start, length)
        with self.lock:
            self.calls += 1
            self.populated += done
            self.threads.add(threading.current_thread().name)
        return done


class RefusingMadvise:
    """``madvise`` as an old kernel answers MADV_POPULATE_WRITE: EINVAL."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        monkeypatch.setattr(direct_io, "_populate_support", None)  # probed again; restored after the test
        monkeypatch.setattr(direct_io, "_madvise", self)

    def __call__(self, start: int, length: int, advice: int) -> None:
        self.calls += 1
        raise OSError(errno.EINVAL, "Invalid argument")


def odd_state(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of awkward sizes: several chunks, odd byte counts, under a page, empty, 0-d, other dtypes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "multi_chunk": torch.randn(3 * CHUNK // 4 + 1001, generator=generator),  # 3 chunks + odd tail
        "odd_bytes": torch.randint(0, 256, (CHUNK + 12_345,), generator=generator, dtype=torch.uint8),
        "half": torch.randn(70_001, generator=generator).to(torch.bfloat16),
        "under_a_page": torch.randn(37, generator=generator),
        "exactly_a_page": torch.randint(0, 256, (PAGE,), generator=generator, dtype=torch.uint8),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "matrix": torch.randn(513, 1031, generator=generator, dtype=torch.float64),
    }


def save(manager_factory: ManagerFactory, state: dict[str, Any], **options: Any) -> None:
    manager = manager_factory(**options)
    with override(chunk_bytes=CHUNK, direct_io_min_bytes=64 * 1024):
        manager.save(1, state, force=True)
        manager.wait()
    manager.close()


def untouched_targets(saved: dict[str, torch.Tensor], keep: list[Any]) -> dict[str, torch.Tensor]:
    """For each saved tensor: a never-written target, page-aligned, unaligned (torch's allocator, and a
    view at an odd byte offset into fresh pages) or non-contiguous, by turns."""
    targets: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(saved.items()):
        nbytes = tensor.numel() * tensor.element_size()
        kind = i % 4
        if kind == 0:
            targets[name] = torch.empty_like(tensor)
        elif kind == 1:
            targets[name] = direct_io.aligned_empty(tensor.shape, tensor.dtype)
        elif kind == 2 and nbytes and tensor.dtype.itemsize == 1:
            pages, raw = fresh_pages(nbytes + PAGE)
            keep.append(pages)
            targets[name] = raw[3:3 + nbytes].view(tensor.shape)  # starts 3 bytes into a page
        elif tensor.dim() == 2:
            targets[name] = torch.empty(tensor.shape[::-1], dtype=tensor.dtype).t()  # non-contiguous
        else:
            targets[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
    return targets


def test_restore_into_never_written_targets_returns_the_saved_bytes(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = odd_state(seed=1)
    save(manager_factory, saved)
    keep: list[Any] = []
    live = untouched_targets(saved, keep)
    assert not live["matrix"].is_contiguous()
    assert any(t.numel() and t.data_ptr() % PAGE for t in live.values()), "an unaligned target is tested"
    counting = CountingPrefault(monkeypatch)
    with override(read_threads=4):
        assert manager_factory().restore(live) == 1
    assert_same_state(live, saved)
    assert counting.calls >= 5  # every chunk from 256 KiB on
    assert all(name.startswith("ckptd-read") for name in counting.threads), counting.threads
    if kernel_populates():
        assert counting.populated == counting.calls


def test_restore_into_an_empty_state_allocates_and_returns_every_value(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values the live state lacks (an optimizer that has not stepped, a fresh dict) are read into
    tensors the reader allocates, with the reads deferred like those into live tensors; an array copied
    into a live array and a pickled value are used only after their bytes arrived (reads are slowed to
    make that matter)."""
    saved: dict[str, Any] = {**odd_state(seed=2), "array": np.arange(300_000, dtype=np.int32).reshape(600, 500),
                             "object": set(range(50_000))}  # pickled
    save(manager_factory, saved, allow_pickle=True)
    real_read_chunk, lock, running, peak = step_reader.read_chunk, threading.Lock(), [0], [0]
    overlapped, first = threading.Event(), [True]

    def slow_read_chunk(*args: Any, **kwargs: Any) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] >= 2:
                overlapped.set()
            waits, first[0] = first[0], False
        try:
            if waits:  # the first read runs until a second one starts, however slowly the others are handed out
                overlapped.wait(60)
            threading.Event().wait(0.05)
            real_read_chunk(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(step_reader, "read_chunk", slow_read_chunk)
    array = np.zeros_like(saved["array"])
    live: dict[str, Any] = {"array": array}  # restored into in place; everything else is absent
    with override(read_threads=4):
        assert manager_factory(allow_pickle=True).restore(live) == 1
    assert sorted(live) == sorted(saved)
    assert_same_state({name: live[name] for name in saved}, saved)
    assert live["array"] is array
    assert peak[0] >= 2, "reads into allocated tensors overlap instead of running tensor by tensor"
    assert pickle.dumps(live["object"]) == pickle.dumps(saved["object"])  # a set: not in assert_same_state's walk


def test_a_fresh_optimizer_is_restored_to_the_saved_bytes(manager_factory: ManagerFactory) -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Linear(700, 5))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    save(manager_factory, {"model": model, "optim": optimizer})
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    expected_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Linear(700, 5))
    fresh_optimizer = torch.optim.Adam(fresh.parameters())  # no state tensors yet
    assert manager_factory().restore({"model": fresh, "optim": fresh_optimizer}) == 1
    assert_same_state(dict(fresh.state_dict()), expected)
    assert_same_state(fresh_optimizer.state_dict()["state"], expected_optim)


def test_where_the_kernel_refuses_to_prefault_the_restore_returns_the_saved_bytes(
        manager_factory: ManagerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = odd_state(seed=4)
    save(manager_factory, saved)
    refusing = RefusingMadvise(monkeypatch)
    counting = CountingPrefault(monkeypatch)
    keep: list[Any] = []
    live = untouched_targets(saved, keep)
    absent: dict[str, Any] = {}
    with override(read_threads=4):
        restorer = manager_factory()
        assert restorer.restore(live) == 1
        assert restorer.restore(absent) == 1
    assert_same_state(live, saved)
    assert_same_state(absent, saved)
    assert refusing.calls == 1, "the probe's EINVAL means unsupported: ckptd stops asking"
    assert counting.calls >= 10 and counting.populated == 0


def test_prefault_maps_whole_pages_and_keeps_their_contents() -> None:
    pages, raw = fresh_pages(16 * PAGE)
    start = raw.data_ptr()
    raw[PAGE:2 * PAGE] = 7  # one page written, the rest never touched
    assert resident_pages(start, 16 * PAGE) == [False, True] + [False] * 14
    done = direct_io.prefault(start + 100, 10 * PAGE)  # pages 1..9 lie wholly inside, 0 and 10 partly
    if not kernel_populates():
        assert not done
        return
    assert done
    assert resident_pages(start, 16 * PAGE) == [False] + [True] * 9 + [False] * 6
    assert torch.all(raw[PAGE:2 * PAGE] == 7) and torch.all(raw[2 * PAGE:] == 0) and torch.all(raw[:PAGE] == 0)
    assert not direct_io.prefault(start + 1, PAGE), "a range without a whole page is left alone"
    assert not direct_io.prefault(0, 16 * PAGE)  # nothing mapped there: that range fails, not the support
    assert direct_io.prefault(start, PAGE)
    del raw
    pages.close()


def test_prefaulted_empty_falls_back_to_touching_the_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = RefusingMadvise(monkeypatch)
    tensor = direct_io.prefaulted_empty((64 * PAGE // 4,), torch.float32)
    assert refusing.calls == 1
    assert tensor.data_ptr() % PAGE == 0
    assert all(resident_pages(tensor.data_ptr(), 64 * PAGE))
    assert torch.count_nonzero(tensor) == 0


def mapping_flags(address_: int) -> str:
    """The permission flags (``rw-p`` / ``rw-s``) of the mapping that holds an address."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, flags = line.split()[:2]
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address_ < high:
                return flags
    raise AssertionError(f"address {address_:#x} is not mapped")


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/maps")
def test_buffers_ckptd_allocates_are_private_memory() -> None:
    """Python maps anonymous memory shared (shmem) unless told otherwise: dearer faults, and a forked
    child would write into the parent's buffers."""
    tensor = direct_io.aligned_empty((1 << 20,), torch.float32)
    prefaulted = direct_io.prefaulted_empty((1 << 20,), torch.uint8)
    assert mapping_flags(tensor.data_ptr()) == "rw-p"
    assert mapping_flags(prefaulted.data_ptr()) == "rw-p"
    assert mapping_flags(direct_io.address(direct_io._bounce_buffer())) == "rw-p"
