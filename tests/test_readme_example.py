"""The README's training-loop example, read from README.md itself (not a copy) and run as the README says:
``python train.py ckpt 60``, then ``python train.py ckpt 100``, each in a fresh process against the embedded
S3 (moto's server on loopback) that the example starts. Checked: both runs reach their last step, the
second one restores step 60 and trains on to 100, and the local tier then holds the steps the example's
policy keeps, whose newest restores in this process with the shapes the example trained.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SECTION = "## A training loop in 20 lines"
#: Only a hang trips this: each run takes about 15 s on an idle 2-core machine.
RUN_DEADLINE_S = 300


def example_code(readme: Path = README) -> str:
    """The first Python block of the README's training-loop section."""
    text = readme.read_text(encoding="utf-8")
    start = text.find(SECTION)
    assert start >= 0, f"README.md has no {SECTION!r} section"
    found = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None, f"README.md: no python block in {SECTION!r}"
    return found.group(1)


def _run(script: Path, root: str, last_step: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTD_", "AWS_"))}
    env["CKPTD_DAEMON"] = "off"  # the example must not hand its steps to a daemon the machine may run
    done = subprocess.run([sys.executable, str(script), root, str(last_step)], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=RUN_DEADLINE_S, check=False)
    assert done.returncode == 0, f"the README example exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_readme_example_is_the_documented_size() -> None:
    code = example_code()
    lines = [line for line in code.splitlines() if line.strip()]
    assert 15 <= len(lines) <= 30, f"the README's training-loop example has {len(lines)} lines"
    assert "EmbeddedS3" in code and "create_bucket" in code, "the example must create the bucket it uses"


def test_the_readme_example_runs_and_resumes_on_a_second_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(example_code())

    first = _run(script, "ckpt", 60)
    assert "resuming after step 0" in first and "trained to step 60" in first, first
    second = _run(script, "ckpt", 100)
    assert "resuming after step 60" in second and "trained to step 100" in second, second

    import torch

    import ckptd

    local = tmp_path / "ckpt" / "local"
    steps = sorted(int(path.name.removeprefix("step-")) for path in local.glob("step-*"))
    assert steps == [90, 100], steps  # every_steps=10, keep_local=2
    model = torch.nn.Linear(16, 1)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.05)}
    before = model.weight.detach().clone()
    manager = ckptd.CheckpointManager(str(local), daemon="off")
    try:
        assert manager.restore(state) == 100
    finally:
        manager.close()
    assert not torch.equal(model.weight, before), "the restored weights are the fresh model's"
