"""A hypothesis state machine over save / promote / gc (also during a promotion) / restore against moto's
server: GC never deletes a chunk of a retained step, and the object tier never lists a step it cannot
restore byte for byte."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import ckptd
from ckptd.config import override
from ckptd.stepio.step_reader import ChunkSource, StepReader, load_step_manifest, load_rank_index, verify_step
from ckptd.policy import KeepLatest
from ckptd.promotion import Promoter, collect_garbage, stored_chunks
from ckptd.promotion.contents import read_step_contents
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3

_FROZEN = [torch.randn(16 * 1024, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]


def _machine(server, workdir: Path) -> type[RuleBasedStateMachine]:
    class PromotionMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            bucket = f"sm-{uuid.uuid4().hex[:12]}"
            server.create_bucket(bucket)
            self.remote = object_tier(bucket, server.storage_options)
            self.settings = override(chunk_bytes=16 * 1024)
            self.settings.__enter__()
            self.manager = ckptd.CheckpointManager(tempfile.mkdtemp(dir=workdir), capture_rng=False,
                                                   policy=ckptd.Policy(keep_local=None))
            self.saved: dict[int, dict[str, torch.Tensor]] = {}
            self.retained: set[int] = set()  # steps the model says the object tier must hold
            self.next_step = 1

        def teardown(self) -> None:
            self.manager.close()
            self.settings.__exit__(None, None, None)

        @rule(frozen=st.sampled_from([0, 1]), value=st.integers(0, 3))
        def save(self, frozen: int, value: int) -> None:
            state = {"frozen": _FROZEN[frozen], "trained": torch.full((512,), float(value))}
            self.manager.save(self.next_step, state)
            self.manager.wait()
            self.saved[self.next_step] = {name: tensor.clone() for name, tensor in state.items()}
            self.next_step += 1

        def _unpromoted(self) -> list[int]:
            return sorted(set(self.saved) - self.retained)

        @precondition(lambda self: self._unpromoted())
        @rule(data=st.data())
        def promote(self, data: st.DataObject) -> None:
            step = data.draw(st.sampled_from(self._unpromoted()))
            Promoter(self.manager.local, self.remote).promote(step)
            self.retained.add(step)

        @rule(keep=st.integers(1, 3))
        def gc(self, keep: int) -> None:
            collect_garbage(self.remote, retention=KeepLatest(keep))
            self.retained = set(sorted(self.retained)[-keep:])

        @precondition(lambda self: self._unpromoted())
        @rule(data=st.data(), keep=st.integers(1, 2), when=st.sampled_from(["marked", "chunks", "verified"]))
        def gc_during_promotion(self, data: st.DataObject, keep: int, when: str) -> None:
            step = data.draw(st.sampled_from(self._unpromoted()))

            def collect(phase: str) -> None:
                if phase == when:
                    collect_garbage(self.remote, retention=KeepLatest(keep))
                    self.retained = set(sorted(self.retained)[-keep:])

            Promoter(self.manager.local, self.remote, on_phase=collect).promote(step)
            self.retained.add(step)

        @precondition(lambda self: self.retained)
        @rule(data=st.data())
        def restore(self, data: st.DataObject) -> None:
            step = data.draw(st.sampled_from(sorted(self.retained)))
            index = load_rank_index(self.remote, load_step_manifest(self.remote, step), 0)
            reader = StepReader([ChunkSource(self.remote, index)])
            for name, expected in self.saved[step].items():
                assert torch.equal(reader.read_tensor(name), expected)

        @invariant()
        def listed_steps_are_the_retained_ones_and_intact(self) -> None:
            committed = self.remote.committed_steps()
            assert set(committed) == self.retained
            stored = set(stored_chunks(self.remote))
            for step in committed:
                assert set(read_step_contents(self.remote, step).unique_chunks()) <= stored
                assert list(verify_step(self.remote, step)) == []

    return PromotionMachine


@pytest.mark.slow
def test_gc_never_breaks_a_retained_step(s3_server, tmp_path):
    machine = _machine(s3_server, tmp_path)
    run_state_machine_as_test(machine, settings=settings(max_examples=6, stateful_step_count=10, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))
