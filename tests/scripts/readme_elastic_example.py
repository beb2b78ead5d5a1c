"""Runs the documented elastic example as ``__main__``: the code block of the "Elastic launch" section of
docs/elastic.md, read from that page itself (not a copy), for ``tests/test_elastic_readme_example.py``.

``ckptd launch [options] tests/scripts/readme_elastic_example.py MANIFEST ROOT`` runs the example with
``sys.argv = [docs/elastic.md, MANIFEST, ROOT]``. It only observes: every batch the example's ShardLoader hands to
the training loop is recorded (``<out>/rank<r>-batches.jsonl``: pid, the generation the process started in, step, the samples' ``id``
field), and once ``ckptd.elastic.run`` returns, the weights of the model ``setup()`` built, as hex bytes
(``<out>/rank<r>-final.json``). ``<out>`` is ``$README_EXAMPLE_OUT``. ``README_EXAMPLE_KILL=R:S``: rank R
SIGKILLs itself as it is about to hand out step S, in generation 0 only; ``README_EXAMPLE_STEP_SLEEP=R:S``:
rank R's processes started in generation 0 take S seconds more for every step (a job still running when
the test acts on it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ckptd.elastic
from ckptd.data import ShardLoader

PAGE = Path(__file__).resolve().parents[2] / "docs" / "elastic.md"


def example_code(page: Path = PAGE) -> str:
    """The first Python block of the "Elastic launch" section of docs/elastic.md."""
    text = page.read_text(encoding="utf-8")
    section = text[text.index("## Elastic launch"):]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    if found is None:
        raise RuntimeError(f"{page}: no python block in the Elastic launch section")
    return found.group(1)


def _observe(out: Path) -> dict[str, Any]:
    rank = os.environ["RANK"]
    kill = os.environ.get("README_EXAMPLE_KILL", "")
    kill_rank, _, kill_step = kill.partition(":")
    first_generation = os.environ.get("CKPTD_GENERATION") == "0"
    slow_rank, _, seconds = os.environ.get("README_EXAMPLE_STEP_SLEEP", "").partition(":")
    pause = float(seconds) if slow_rank == rank and first_generation else 0.0
    lines = (out / f"rank{rank}-batches.jsonl").open("a", encoding="utf-8")
    handed = ShardLoader.__iter__

    def observed(loader: ShardLoader) -> Any:
        for batch in handed(loader):
            step = loader.batches_taken
            if first_generation and kill_rank == rank and str(step) == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            lines.write(json.dumps({"pid": os.getpid(), "started_in": os.environ.get("CKPTD_GENERATION"),
                                    "world": loader.dataset.schedule.world_size, "step": step,
                                    "ids": [int(i) for i in batch["id"]]}) + "\n")
            lines.flush()
            if pause:
                time.sleep(pause)
            yield batch

    ShardLoader.__iter__ = observed  # type: ignore[method-assign]
    built: dict[str, Any] = {}
    run = ckptd.elastic.run

    def recorded_run(train_fn: Any, *, setup_fn: Any = None, **options: Any) -> Any:
        def setup() -> Any:
            built["state"] = setup_fn()
            return built["state"]

        result = run(train_fn, setup_fn=setup, **options)
        model = built["state"]["model"]
        weights = {name: tensor.detach().numpy().tobytes().hex() for name, tensor in model.state_dict().items()}
        (out / f"rank{rank}-final.json").write_text(json.dumps(weights, sort_keys=True))
        return result

    ckptd.elastic.run = recorded_run  # type: ignore[assignment]
    return built


if __name__ == "__main__":
    _observe(Path(os.environ["README_EXAMPLE_OUT"]))
    code = example_code()
    sys.argv = [str(PAGE), *sys.argv[1:]]
    exec(compile(code, f"{PAGE}:elastic-example", "exec"), {"__name__": "__main__"})
