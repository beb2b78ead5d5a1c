"""The Hugging Face integrations refuse what they cannot serve with a clear error, not a traceback.

A missing framework is a real absence for the interpreter: a child process whose ``sys.modules`` maps the
framework to None (what Python does for a module that must not be imported), so ``import transformers``
raises ImportError there exactly as on a machine without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integrations

#: What a user may write, and the framework each needs; one child process tries them all.
_STATEMENTS = [
    ("transformers", "from ckptd.plugins.huggingface import CkptdCallback"),
    ("transformers", "from ckptd.plugins.huggingface import ckptd_resume"),
    ("accelerate", "from ckptd.plugins.huggingface import CkptdAccelerate"),
    ("transformers", "import ckptd.plugins.huggingface.trainer"),
    ("transformers", "from ckptd.plugin_loading import load_integration; load_integration('huggingface')"),
    ("accelerate", "from ckptd.plugin_loading import load_integration; load_integration('accelerate')"),
]

_CHILD = """
import json, sys
sys.modules["transformers"] = sys.modules["accelerate"] = None
from ckptd.errors import PluginError
results = []
for statement in json.loads(sys.argv[1]):
    try:
        exec(statement)
    except PluginError as error:
        results.append({"type": type(error).__name__, "message": error.message, "hint": error.hint})
    except Exception as error:
        results.append({"type": type(error).__name__, "message": str(error)})
    else:
        results.append({"type": None})
print(json.dumps(results))
"""


def test_a_missing_framework_gives_the_install_hint():
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([statement for _, statement in _STATEMENTS])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(_STATEMENTS)
    for (framework, statement), error in zip(_STATEMENTS, results):
        assert error["type"] == "PluginError", (statement, error)
        assert error["hint"] == "pip install 'ckptd[huggingface]'", (statement, error)
        assert repr(framework) in error["message"], (statement, error)


def test_the_callback_needs_a_directory_and_the_resume_needs_the_callback(tmp_path):
    from transformers import Trainer, TrainingArguments
    import torch

    from ckptd.errors import ConfigError
    from ckptd.plugins.huggingface import CkptdCallback, ckptd_resume

    with pytest.raises(ConfigError, match="needs a local directory"):
        CkptdCallback()
    model = torch.nn.Linear(2, 2)
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[],
                                                          use_cpu=True))
    with pytest.raises(ConfigError, match="exactly one CkptdCallback"):
        ckptd_resume(trainer)


def test_load_state_of_a_directory_not_saved_through_ckptd_is_refused(tmp_path):
    import torch
    from accelerate import Accelerator

    from ckptd.errors import ResumeMismatchError
    from ckptd.plugins.huggingface import CkptdAccelerate

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(str(tmp_path / "plain"))  # before the hooks: accelerate's own checkpoint
    hooks = CkptdAccelerate(accelerator, tmp_path / "ckpt")
    try:
        with pytest.raises(ResumeMismatchError, match="was not saved through ckptd") as caught:
            accelerator.load_state(str(tmp_path / "plain"))
        assert caught.value.path.endswith("ckptd-step.json")
        hooks.remove()
        accelerator.load_state(str(tmp_path / "plain"))  # without the hooks, accelerate's own load works
        assert model.weight.shape == (2, 2)
    finally:
        hooks.close()


class _Planted:
    """Unpickled, it creates the directory it names: proof that something ran pickle on a file."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (self.proof,)


def test_load_state_through_the_hooks_refuses_to_unpickle_accelerates_files(tmp_path):
    """accelerate would unpickle custom_checkpoint_0.pkl (weights_only=False) after ckptd's restore and load it
    over ckptd's verified values: refused before anything is read; restore(step) resumes without it."""
    import torch
    from accelerate import Accelerator

    from ckptd.errors import PickleRefusedError
    from ckptd.plugins.huggingface import CkptdAccelerate

    class Progress:
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.step = int(state["step"])

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    hooks = CkptdAccelerate(accelerator, tmp_path / "ckpt", step=lambda: progress.step)
    try:
        progress.step = 3
        saved = model.weight.detach().clone()
        accelerator.save_state(str(tmp_path / "out"))
        hooks.manager.wait()
        proof = tmp_path / "unpickled"
        torch.save(_Planted(str(proof)), tmp_path / "out" / "custom_checkpoint_0.pkl")
        with torch.no_grad():
            model.weight.add_(1.0)
        progress.step = 99
        with pytest.raises(PickleRefusedError, match=r"restore\(3\)") as caught:
            accelerator.load_state(str(tmp_path / "out"))
        assert caught.value.step == 3 and "custom_checkpoint_0.pkl" in caught.value.message
        assert not proof.exists(), "a file of accelerate's was unpickled"
        assert progress.step == 99, "the refused load changed the state"
        assert hooks.restore(3) == 3
        assert progress.step == 3 and torch.equal(model.weight, saved)
        assert not proof.exists()
    finally:
        hooks.close()
