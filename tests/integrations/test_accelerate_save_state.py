"""``accelerator.save_state`` through CkptdAccelerate writes nothing large outside ckptd: the output directory
holds the step marker only (no weights, optimizer.bin, scheduler.bin, pickles or sampler files), named and
pruned as accelerate names and prunes it (``ProjectConfiguration``'s automatic naming and ``total_limit``);
``remove()`` gives accelerate its own ``save_state`` back. A prepared loader whose position ckptd cannot capture
is named in one warning. Real accelerate on CPU, in this process.
"""

from __future__ import annotations

import json

import logging
from pathlib import Path
from typing import Any

import pytest
import torch


def _prepared(tmp_path: Path, **accelerator_options: Any) -> tuple[Any, torch.nn.Module, Any]:
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, **accelerator_options)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=10)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.backward(model(torch.randn(4, 64)).square().mean())
    optimizer.step()
    scheduler.step()
    return accelerator, model, optimizer


def _files(directory: Path) -> dict[str, int]:
    return {str(path.relative_to(directory)): path.stat().st_size for path in sorted(directory.rglob("*"))
            if path.is_file()}


def test_save_state_leaves_only_the_marker_named_and_pruned_as_accelerate_does(tmp_path: Path) -> None:
    from accelerate.utils import ProjectConfiguration

    from ckptd.plugins.huggingface import CkptdAccelerate

    project = ProjectConfiguration(project_dir=str(tmp_path / "project"), automatic_checkpoint_naming=True,
                                   total_limit=2)
    accelerator, model, _ = _prepared(tmp_path, project_config=project)
    seen: list[tuple[int, str]] = []
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: seen.append((len(weights),
                                                                                              output_dir)))
    hooks = CkptdAccelerate(accelerator, tmp_path / "ckpt")
    returned = [accelerator.save_state() for _ in range(3)]
    checkpoints = tmp_path / "project" / "checkpoints"
    assert returned == [str(checkpoints / f"checkpoint_{i}") for i in range(3)]
    assert seen == [(1, path) for path in returned], "the user's own pre-hook did not run as accelerate runs it"
    files = _files(checkpoints)
    assert list(files) == ["checkpoint_1/ckptd-step.json", "checkpoint_2/ckptd-step.json"], files
    assert all(size < 64 for size in files.values()), files
    hooks.manager.wait()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    assert hooks.restore(returned[1]) == 2 and accelerator.save_iteration == 2
    assert any(parameter.abs().sum() > 0 for parameter in model.parameters())
    accelerator.load_state()  # the newest folder, as accelerate picks it: through ckptd, nothing unpickled
    assert accelerator.save_iteration == 3

    # step 3 lost (the run died before it committed): the fallback goes back to step 2, and the next save of
    # step 3 reuses checkpoint_2, which holds only the marker
    hooks.manager.wait()
    hooks.manager.local.delete_step(3)
    assert hooks.restore(returned[2]) == 2 and accelerator.save_iteration == 2
    assert accelerator.save_state() == returned[2], "the marker-only folder of that iteration is reused"
    hooks.manager.wait()
    assert json.loads((Path(returned[2]) / "ckptd-step.json").read_text()) == {"step": 3}

    hooks.remove()
    assert "save_state" not in vars(accelerator) and "load_state" not in vars(accelerator)
    own = accelerator.save_state()
    assert "optimizer.bin" in _files(Path(own)), "accelerate's own save_state is not back after remove()"
    hooks.close()


def test_save_state_to_a_directory_writes_the_marker_only(tmp_path: Path) -> None:
    from ckptd.plugins.huggingface import CkptdAccelerate

    accelerator, _, _ = _prepared(tmp_path)
    hooks = CkptdAccelerate(accelerator, tmp_path / "ckpt", step=lambda: 100)
    assert accelerator.save_state(str(tmp_path / "out" / "step_100")) == str(tmp_path / "out" / "step_100")
    assert _files(tmp_path / "out") == {"step_100/ckptd-step.json": len('{"step": 100}\n')}
    hooks.manager.wait()
    assert hooks.manager.tiers[0].committed_steps() == [100]
    hooks.close()


def test_a_loader_whose_position_cannot_be_captured_warns_once(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration

    from ckptd.plugins.huggingface import CkptdAccelerate

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0))
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, shuffle=True, batch_size=4))
    hooks = CkptdAccelerate(accelerator, tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="ckptd.loaders"):
        next(iter(loader))
        hooks.save(1)
        hooks.save(2)
    warnings = [record.getMessage() for record in caplog.records if record.name == "ckptd.loaders"]
    assert len(warnings) == 1, warnings
    assert "accelerator dataloader 0" in warnings[0] and "DataLoaderDispatcher" in warnings[0]
    assert "use_stateful_dataloader=True" in warnings[0] and "StatefulDataLoader" in warnings[0]
    hooks.close()
