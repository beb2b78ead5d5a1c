"""The object tier keeps the training cadence (issue 26, parts 3 and 5), against moto's server on loopback.

A nanoGPT-like model of about 109k parameters (with its AdamW moments) trains for 60 steps (200 in the slow
group) and is saved every 5 steps to the local tier and S3. The lag is judged in steps, from what the run
records, never in seconds: the first upload is of the first committed step; every upload is of the newest
step committed when it starts (the steps committed meanwhile are skipped, not queued); at most one step is in
flight and one waits; the object tier is never further behind than one save interval plus the steps the last
two uploads spanned; and the newest step is on S3, intact, after ``close()``. ``promotion_lag`` sends no S3
request after the first promotion, nor one per call before it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptd
from ckptd.stepio.step_reader import verify_step
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3

EVERY = 5


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def small_gpt(width: int = 46, layers: int = 4, vocab: int = 65) -> nn.Module:
    """A character-level GPT of about 109k parameters (nanoGPT's shape, shrunk)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, width), *[_Block(width) for _ in range(layers)], nn.LayerNorm(width),
                         nn.Linear(width, vocab))


class _Record:
    """What the run saw, in training steps: the step the loop was at when each local commit and each
    promotion's start and end happened."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loop_step = 0
        self.committed: list[int] = []
        self.commit_delays: list[int] = []  # loop steps from each save to its local commit
        self.starts: list[tuple[int, int, int]] = []  # (step promoted, loop step, newest committed) at the start
        self.ends: list[tuple[int, int]] = []  # (step promoted, loop step) at the end
        self.lags: list[tuple[int, int]] = []  # (loop step, steps behind) after each training step
        self.most_unpromoted = 0


def _train(root: Path, url: str, options: dict[str, Any], steps: int) -> _Record:
    record = _Record()
    model = small_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with ckptd.CheckpointManager(root, remote=url, storage_options=options, capture_rng=False, daemon="off",
                                 policy=ckptd.Policy(keep_local=2)) as manager:
        uploader = manager.uploader
        assert uploader is not None

        def committed(step: int) -> None:
            with record.lock:
                record.committed.append(step)
                record.commit_delays.append(max(0, record.loop_step - step))

        manager._saver.on_commit.insert(0, committed)
        promote = uploader.promoter.promote

        def recorded_promote(step: int, **kwargs: Any) -> Any:
            with record.lock:
                record.starts.append((step, record.loop_step, max(record.committed)))
            report = promote(step, **kwargs)
            with record.lock:
                record.ends.append((step, record.loop_step))
            return report

        uploader.promoter.promote = recorded_promote  # type: ignore[method-assign]
        generator = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 65, (8, 64), generator=generator)
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 65), tokens.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % EVERY == 0:
                manager.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            with record.lock:
                record.loop_step = step
            lag = manager.promotion_lag
            assert lag is not None
            record.lags.append((step, lag.steps_behind))
            record.most_unpromoted = max(record.most_unpromoted, len(uploader.unpromoted))
    return record


def _check_cadence(record: _Record, steps: int, remote: Any) -> None:
    saved = list(range(EVERY, steps + 1, EVERY))
    assert record.committed == saved
    assert remote.committed_steps()[-1] == steps, "the newest step is on S3 after close()"
    assert list(verify_step(remote, steps)) == []
    promoted = [step for step, _, _ in record.starts]
    assert promoted == sorted(set(promoted)) and promoted[-1] == steps
    for step, _, newest in record.starts:
        # the newest committed step, or the one before it (a commit may land between the uploader's pick and
        # the upload's start); never one further back: the older waiting steps are skipped
        assert step >= newest - 2 * EVERY, f"step {step} was uploaded while step {newest} was committed: " \
                                           "uploads start with the newest committed step, skipping older ones"
    assert record.most_unpromoted <= 2, "at most one step in flight and one waiting"
    # The object tier's newest step at loop step t is the one whose upload ended last; it was the newest
    # committed step (or the one before) when that upload started, so the lag is at most two save intervals
    # and the local commit's delay plus the steps from that upload's start to t, which span at most that
    # upload and the one in flight.
    spans = [end - start for (_, start, _), (_, end) in zip(record.starts, record.ends)]
    slack = 2 * EVERY + max(record.commit_delays) + 1
    for loop_step, behind in record.lags:
        landed = [start for (_, start, _), (_, end) in zip(record.starts, record.ends) if end < loop_step]
        if len(landed) >= 2:  # the lag learns of the last upload a moment after it returns: judged by the one before
            assert behind <= slack + (loop_step - landed[-2]), (loop_step, behind, record.starts, record.ends)
        assert behind <= max(slack + 2 * max(spans), loop_step), (loop_step, behind, spans)


def test_a_60_step_loop_keeps_the_object_tier_at_the_training_cadence(tmp_path: Path, s3_server, s3_bucket) -> None:
    record = _train(tmp_path / "local", f"s3://{s3_bucket}/run", s3_server.storage_options, 60)
    _check_cadence(record, 60, object_tier(s3_bucket, s3_server.storage_options))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_200_step_loop_keeps_the_object_tier_at_the_training_cadence(tmp_path: Path, s3_server,
                                                                        s3_bucket) -> None:
    record = _train(tmp_path / "local", f"s3://{s3_bucket}/run", s3_server.storage_options, 200)
    _check_cadence(record, 200, object_tier(s3_bucket, s3_server.storage_options))


def test_promotion_lag_sends_no_request_to_s3(tmp_path: Path, s3_server, s3_bucket) -> None:
    sent: list[str] = []
    state = {"weights": torch.randn(20_000)}
    with ckptd.CheckpointManager(tmp_path / "local", remote=f"s3://{s3_bucket}/run", daemon="off",
                                 storage_options=s3_server.storage_options, capture_rng=False) as manager:
        manager.remote.on_request(lambda request, **_: sent.append(f"{request.method} {request.url}"))
        for _ in range(50):  # before the first save: known from the uploader's one listing at its start
            lag = manager.promotion_lag
            assert lag is not None and lag.local_step is None and lag.steps_behind == 0
        assert len(sent) <= 2, f"promotion_lag asked S3 before the first promotion: {sent}"
        manager.save(1, state)
        manager.wait_uploads()
        state["weights"].add_(1.0)
        manager.save(2, state)
        manager.wait_uploads()
        before = list(sent)
        for _ in range(200):
            lag = manager.promotion_lag
            assert lag is not None and (lag.local_step, lag.remote_step, lag.steps_behind) == (2, 2, 0)
        assert sent == before, f"promotion_lag sent {len(sent) - len(before)} request(s) after the first promotion"
