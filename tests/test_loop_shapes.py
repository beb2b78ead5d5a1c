"""Exact resume for every common loop shape: a training child is killed with SIGKILL at a random save
(a seeded choice of phase and step), a new child resumes from the newest committed step, and its final
weights, optimizer state and the sample ids of every step equal those of a run that never crashed, bit
for bit, with 0 and 2 DataLoader workers and across epoch boundaries.

The shapes (see docs/data-loader.md, "Using ckptd in an existing training script"): fetch-then-train; nanoGPT's
prefetch-next with the save before the step (steps from 0); the same counted from 1 (``start_step=1``);
gradient accumulation with the next micro-batch fetched ahead (``batches_per_step``); the loader wrapped
in the user's own generator; a CUDA-stream-style prefetcher that keeps one batch preloaded on top of
the loop's own. A save whose step does not fit the batches taken is reported (LoaderPositionError).
"""

from __future__ import annotations

import ctypes
import functools
import io
import multiprocessing
import os
import random
import signal
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptd import CheckpointManager, Policy
from ckptd.data import DatasetManifest, ShardDataset, ShardLoader, index_dataset
from ckptd.errors import LoaderPositionError
from ckptd.testing.compare import assert_same_state
from harness import crash
from harness.crash import Channel, CrashInjector, KillAt
from harness.fixtures import crash_injector  # noqa: F401

# Building an optimizer imports torch._dynamo (about 4 s here); the injector's forkserver children
# inherit what it preloaded, and it starts after collection, so preloading it here spares every child.
if "torch._dynamo" not in crash.PRELOAD:
    crash.PRELOAD = (*crash.PRELOAD, "torch._dynamo")

SEQ_LEN, VOCAB, BATCH = 9, 256, 4
WINDOWS = 26  # 6 batches of 4 per epoch, 2 windows left over
STEPS, EVERY, MICRO = 13, 2, 2
SHAPES = ("fetch_then_train", "nanogpt_prefetch", "prefetch_from_one", "grad_accum_prefetch", "own_generator",
          "stream_prefetcher")


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.drop = torch.nn.Dropout(0.2)  # draws from the torch RNG: the RNG state must resume too
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(tokens)))


class _Trainer:
    """Model, optimizer and the ids trained at each step; ``step(batches, number)`` trains one step."""

    def __init__(self, channel: Channel | None) -> None:
        torch.manual_seed(0)
        self.model = _TinyLM()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.channel = channel
        self.seen: dict[int, list[str]] = {}

    def step(self, batches: list[tuple[Any, list[str]]], number: int) -> None:
        for (inputs, targets), _ in batches:
            logits = self.model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) / len(batches)
            loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        self.seen[number] = [sample for _, ids in batches for sample in ids]
        if self.channel is not None:
            self.channel.report((number, self.seen[number]))


class _Preloader:
    """What CUDA-stream prefetchers (apex's ``data_prefetcher``) do, without a GPU: keep the next batch
    loaded (on a side stream, in real code) while the current one trains; ``next()`` returns it and
    starts loading the one after."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.loaded: deque[Any] = deque()
        self._preload()

    def _preload(self) -> None:
        item = next(self.source, None)
        if item is not None:
            self.loaded.append(item)

    def next(self) -> Any:
        item = self.loaded.popleft() if self.loaded else None
        self._preload()
        return item


def _loader(manifest: DatasetManifest, cache: str, workers: int, **options: Any) -> ShardLoader:
    dataset = ShardDataset(manifest, global_batch_size=BATCH, seed=11, cache_dir=cache, split_targets=True)
    return ShardLoader(dataset, num_workers=workers, with_sample_ids=True, **options, **_WORKER_OPTIONS)


#: DataLoader options of the training child (see train_shape).
_WORKER_OPTIONS: dict[str, Any] = {}


def _worker_init(fd: int, parent: int, worker_id: int) -> None:
    """A DataLoader worker of the training child: die with the child (as its SIGKILL would take a whole
    job's processes; torch's own check of the parent runs only every 5 s, and until then the worker holds
    the checkpoint directory's lock it inherited) and close its copy of the pipe to the test."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)
    os.close(fd)


def _loop(shape: str, manifest: DatasetManifest, cache: str, workers: int, trainer: _Trainer,
          restore: Callable[[dict[str, Any]], int | None], save: Callable[[int, dict[str, Any]], None]) -> None:
    """Train ``STEPS`` steps in the loop ``shape``; ``restore``/``save`` are the manager's (or no-ops)."""
    if shape == "grad_accum_prefetch":
        loader = _loader(manifest, cache, workers, steps=STEPS, batches_per_step=MICRO)
    elif shape == "prefetch_from_one":
        loader = _loader(manifest, cache, workers, steps=STEPS, start_step=1)
    elif shape == "own_generator":
        loader = _loader(manifest, cache, workers)  # one epoch per iteration: the generator loops over epochs
    else:
        loader = _loader(manifest, cache, workers, steps=STEPS)
    state = {"model": trainer.model, "optim": trainer.optim, "data": loader}
    restored = restore(state)

    if shape == "fetch_then_train":
        batches = iter(loader)
        for step in range((restored or 0) + 1, STEPS + 1):
            trainer.step([next(batches)], step)
            save(step, state)
    elif shape == "nanogpt_prefetch":  # X, Y = get_batch() before the loop; save(iter_num) before training it
        batches = iter(loader)
        batch, iter_num = next(batches), restored or 0
        while iter_num < STEPS:
            save(iter_num, state)  # right after a resume: the restored step, which save() skips
            trainer.step([batch], iter_num)
            batch = next(batches, None)
            iter_num += 1
    elif shape == "prefetch_from_one":  # the same, steps numbered from 1: ShardLoader(start_step=1)
        batches = iter(loader)
        batch, step = next(batches), restored or 1
        while step <= STEPS:
            if step != restored:
                save(step, state)
            trainer.step([batch], step)
            batch = next(batches, None)
            step += 1
    elif shape == "grad_accum_prefetch":  # nanoGPT's micro-steps: the next micro-batch is fetched after each
        batches = iter(loader)
        batch = next(batches)
        for step in range((restored or 0) + 1, STEPS + 1):
            micro = []
            for _ in range(MICRO):
                micro.append(batch)
                batch = next(batches, None)
            trainer.step(micro, step)
            save(step, state)
    elif shape == "own_generator":
        def stream() -> Iterator[Any]:
            while True:
                for inputs_targets, ids in loader:
                    yield (inputs_targets[0].clone(), inputs_targets[1].clone()), ids  # "to(device)"

        batches = stream()
        for step in range((restored or 0) + 1, STEPS + 1):
            trainer.step([next(batches)], step)
            save(step, state)
    elif shape == "stream_prefetcher":  # input = prefetcher.next() at the end of each step
        prefetcher = _Preloader(iter(loader))
        batch = prefetcher.next()
        for step in range((restored or 0) + 1, STEPS + 1):
            trainer.step([batch], step)
            batch = prefetcher.next()
            save(step, state)
    else:
        raise ValueError(shape)


def train_shape(channel: Channel, shape: str, manifest_json: dict[str, Any], cache: str, workers: int,
                checkpoints: str | None) -> dict[str, Any]:
    """Crash-injector target: train (resuming from ``checkpoints`` when it holds a step); returns the
    restored step, the ids per step, and the final weights and optimizer state."""
    # The injector starts its children as daemons, which multiprocessing forbids to start DataLoader
    # workers. The workers are forked from this child (started through the forkserver this child came
    # from, they would not see it die) and end with it (see _worker_init).
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    if channel is not None:
        _WORKER_OPTIONS.update(multiprocessing_context="fork",
                               worker_init_fn=functools.partial(_worker_init, channel._connection.fileno(),
                                                                os.getpid()))
    manifest = DatasetManifest.from_json(manifest_json)
    trainer = _Trainer(channel)
    restored: list[int | None] = [None]
    if checkpoints is None:
        _loop(shape, manifest, cache, workers, trainer, lambda state: None, lambda step, state: None)
    else:
        with CheckpointManager(checkpoints, policy=Policy(every_steps=EVERY, keep_local=2)) as manager:
            def restore(state: dict[str, Any]) -> int | None:
                restored[0] = manager.restore(state)
                return restored[0]

            _loop(shape, manifest, cache, workers, trainer, restore, lambda step, state: manager.save(step, state))
    weights = io.BytesIO()  # tensors sent through the pipe would travel as shared memory the child takes along
    torch.save({"model": trainer.model.state_dict(), "optim": trainer.optim.state_dict()}, weights)
    return {"restored": restored[0], "seen": trainer.seen, "weights": weights.getvalue()}


def _weights(result: dict[str, Any]) -> dict[str, Any]:
    return torch.load(io.BytesIO(result["weights"]), weights_only=True)


@pytest.fixture(scope="module")
def token_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    root = tmp_path_factory.mktemp("loop-shapes")
    tokens = np.random.default_rng(7).integers(0, VOCAB, WINDOWS * SEQ_LEN, dtype=np.uint16)
    tokens[:13 * SEQ_LEN].tofile(root / "part-0.bin")
    tokens[13 * SEQ_LEN:].tofile(root / "part-1.bin")
    manifest = index_dataset(str(root), "tokens", reader_options={"seq_len": SEQ_LEN}).manifest
    return manifest.to_json(), str(root / "cache")


@pytest.fixture(scope="module")
def references(crash_injector: CrashInjector, token_data: tuple[dict[str, Any], str]) -> dict[str, Any]:
    """Each shape trained without interruption (no workers, no manager)."""
    manifest, cache = token_data
    runs = {}
    for shape in SHAPES:
        child = crash_injector.run(train_shape, shape, manifest, cache, 0, None)
        assert child.error is None, child.error
        runs[shape] = child.value
    return runs


def _kill_points() -> dict[tuple[str, int], KillAt]:
    """A seeded random save of each scenario to die at: just after its commit, or just before it."""
    rng = random.Random(20261201)
    saves = STEPS // EVERY
    return {(shape, workers): KillAt(rng.choice(["committed", "manifest-commit"]), rng.randint(2, saves))
            for shape in SHAPES for workers in (0, 2)}


KILL_POINTS = _kill_points()


def test_references_cross_epochs_and_see_every_window(references: dict[str, Any]) -> None:
    batches_per_epoch = WINDOWS // BATCH
    for shape, run in references.items():
        steps = sorted(run["seen"])
        assert len(steps) == STEPS, shape
        flat = [sample for step in steps for sample in run["seen"][step]]
        first_epoch = flat[:batches_per_epoch * BATCH]
        assert len(set(first_epoch)) == len(first_epoch), shape  # no window twice within an epoch
        assert len(flat) > 2 * batches_per_epoch * BATCH, shape  # the run crosses two epoch boundaries
    # every shape trains the same sample stream (grad accumulation: two batches per step)
    plain = [s for step in sorted(references["fetch_then_train"]["seen"])
             for s in references["fetch_then_train"]["seen"][step]]
    for shape in ("nanogpt_prefetch", "prefetch_from_one", "own_generator", "stream_prefetcher"):
        run = references[shape]["seen"]
        assert [s for step in sorted(run) for s in run[step]] == plain, shape
    accumulated = references["grad_accum_prefetch"]["seen"]
    assert [s for step in sorted(accumulated) for s in accumulated[step]][:len(plain)] == plain


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_resume_after_sigkill_equals_the_uninterrupted_run(crash_injector: CrashInjector, tmp_path: Path,
                                                           token_data: tuple[dict[str, Any], str],
                                                           references: dict[str, Any], shape: str,
                                                           workers: int) -> None:
    manifest, cache = token_data
    kill_at = KILL_POINTS[(shape, workers)]
    crashed = crash_injector.run(train_shape, shape, manifest, cache, workers, str(tmp_path / "ckpt"),
                                 kill_at=kill_at)
    assert crashed.killed, f"not killed at {kill_at}: {crashed.error}"
    resumed = crash_injector.run(train_shape, shape, manifest, cache, workers, str(tmp_path / "ckpt"))
    assert resumed.error is None, resumed.error
    result, reference = resumed.value, references[shape]
    assert result["restored"] is not None, "the crashed run committed no step"
    first_resumed = min(result["seen"])
    before = {step: ids for step, ids in crashed.reports if step < first_resumed}
    assert before == {step: reference["seen"][step] for step in before}
    assert {**before, **result["seen"]} == reference["seen"]  # no step lost, repeated or fed other samples
    final, expected = _weights(result), _weights(reference)
    assert_same_state(final["model"], expected["model"])
    assert_same_state(final["optim"], expected["optim"])


# --- shapes that do not fit are reported ------------------------------------------------------------------
def _small_run(tmp_path: Path, token_data: tuple[dict[str, Any], str], **options: Any
               ) -> tuple[CheckpointManager, ShardLoader, dict[str, Any], Iterator[Any]]:
    manifest, cache = token_data
    loader = _loader(DatasetManifest.from_json(manifest), cache, 0, steps=STEPS, **options)
    manager = CheckpointManager(tmp_path / "ckpt", policy=Policy(every_steps=1), capture_rng=False)
    state = {"model": torch.nn.Linear(2, 2), "data": loader}
    return manager, loader, state, iter(loader)


def test_gradient_accumulation_without_batches_per_step_is_reported(tmp_path: Path, token_data: Any) -> None:
    manager, _, state, batches = _small_run(tmp_path, token_data)
    with manager:
        for _ in range(3 * MICRO):  # three steps of two micro-batches
            next(batches)
        with pytest.raises(LoaderPositionError, match=r"would repeat 3 batch") as caught:
            manager.save(3, state)
        assert "batches_per_step=2" in str(caught.value) and caught.value.step == 3
        assert manager.committed_steps() == []


def test_a_step_number_ahead_of_the_batches_is_reported_as_a_skip(tmp_path: Path, token_data: Any) -> None:
    manager, _, state, batches = _small_run(tmp_path, token_data)
    with manager:
        next(batches)
        manager.save(1, state)  # fits: one batch, one step
        manager.wait()
        next(batches)
        with pytest.raises(LoaderPositionError, match=r"would skip 1 batch") as caught:
            manager.save(3, state)  # the loop numbers its steps one too high
        assert "start_step=1" in str(caught.value)
        assert manager.committed_steps() == [1]  # the committed step is untouched
    manifest, cache = token_data
    fresh = _loader(DatasetManifest.from_json(manifest), cache, 0, steps=STEPS)
    with CheckpointManager(tmp_path / "ckpt", capture_rng=False) as again:
        assert again.restore({"model": torch.nn.Linear(2, 2), "data": fresh}) == 1
    assert (fresh.epoch, fresh.samples_consumed) == (0, BATCH)


def test_a_prefetcher_deeper_than_max_ahead_is_reported_and_max_ahead_admits_it(tmp_path: Path,
                                                                              token_data: Any) -> None:
    manager, _, state, batches = _small_run(tmp_path / "a", token_data)
    with manager:
        for _ in range(1 + 3):  # step 1 trained, three batches queued
            next(batches)
        with pytest.raises(LoaderPositionError, match=r"would repeat 3 batch.*more than the 2"):
            manager.save(1, state)
    manager, loader, state, batches = _small_run(tmp_path / "b", token_data, max_ahead=3)
    with manager:
        for _ in range(1 + 3):
            next(batches)
        assert manager.save(1, state, force=True)
        manager.wait()
    assert loader.state_dict_for_step(1)["samples_consumed"] == BATCH  # the queued batches are not lost


def _run_from_zero(tmp_path: Path, token_data: Any, steps: range, **options: Any) -> list[list[str]]:
    """``for step in steps: train(next(b)); save(step)`` (steps numbered from 0, saved after training), with
    a restore first; the sample ids trained, step by step."""
    manager, loader, state, _ = _small_run(tmp_path, token_data, **options)
    trained = []
    with manager:
        manager.restore(state)
        batches = iter(loader)
        for step in steps:
            trained.append(next(batches)[1])
            manager.save(step, state)
    return trained


def test_a_loop_numbered_from_zero_without_start_step_is_reported_at_its_first_save_after_a_resume(
        tmp_path: Path, token_data: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Counting cannot tell this loop from nanoGPT's at a save (both hold one batch more than the step
    # says); after the resume the loop holds none, so the repeated batch is reported there.
    with caplog.at_level("WARNING", logger="ckptd.data"):
        first = _run_from_zero(tmp_path, token_data, range(0, 3))
        assert "held" not in caplog.text
        again = _run_from_zero(tmp_path, token_data, range(3, 5))
    assert again[0] == first[-1], "the resume trained the last batch again, as the warning says"
    assert "trained 1 batch(es) again" in caplog.text and "start_step=-1" in caplog.text


def test_a_loop_numbered_from_zero_with_start_step_resumes_silently_and_exactly(
        tmp_path: Path, token_data: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ckptd.data"):
        first = _run_from_zero(tmp_path, token_data, range(0, 3), start_step=-1)
        again = _run_from_zero(tmp_path, token_data, range(3, 5), start_step=-1)
    assert again[0] not in first and "held" not in caplog.text


def test_the_fix_the_warning_asks_for_is_not_warned_about_again(tmp_path: Path, token_data: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ckptd.data"):
        _run_from_zero(tmp_path, token_data, range(0, 3))
        _run_from_zero(tmp_path, token_data, range(3, 5), start_step=-1)  # resumed with the argument added
        assert "held" not in caplog.text  # the saved counts were made under start_step=0: not compared
        _run_from_zero(tmp_path, token_data, range(5, 7), start_step=-1)
    assert "held" not in caplog.text
