"""Every fenced code block of README.md and docs/ is run, from the markdown itself, or says why it is not.

Each block carries a marker, an HTML comment on the last non-blank line before its opening fence (the
convention is in docs/architecture.md, "Examples in the docs"):

- ``<!-- example: run -->``: a whole Python script, run as it is (``run: python train.py ckpt 30; python
  train.py ckpt 50`` names the file and the command lines the page gives; each must exit 0, and a command's
  ``expect="TEXT"`` words are texts its output must contain);
- ``<!-- example: fragment SETUP -->``: Python that assumes some state (a manager, a model, a dataset): the
  script is the named setup's preamble, the block, then the setup's checks (``SETUPS`` below);
- ``<!-- example: cli [SETUP] [exit=N] -->``: every line is a ``ckptd`` command, run with the venv's ``ckptd``
  in the directory the setup prepared; each must exit N (default 0);
- ``<!-- example: output [SETUP] -->``: ``$ ckptd ...`` lines and what they print: each command runs, exits 0
  and prints lines of the shape shown (labels, table cells; numbers are not compared);
- ``<!-- example: shape SETUP -->``: a JSON document; the one the setup makes has the same keys;
- ``<!-- example: tested-by tests/x.py -->``: another test runs it (that file must name this page);
- ``<!-- example: not run: REASON -->``.

The pages stand for the user's machine with placeholders that each run maps to its own: ``/nvme/ckpt/`` is a
directory in the test's working directory, ``s3://bucket/`` a fresh bucket on the embedded S3 server (moto on
loopback, also for ``http://minio:9000``). The scripts and commands run in fresh processes, with
``CKPTD_DAEMON=off`` so that no daemon the machine may run takes their steps.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted(path for path in (REPO / "docs").rglob("*.md") if "_hooks" not in path.parts)]
MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[\w+-]*)")
KINDS = ("run", "fragment", "cli", "output", "shape", "tested-by", "not run")
CKPTD = Path(sys.executable).with_name("ckptd")
#: Only a hang trips this: the slowest block's process runs for about 10 s on an idle 2-core machine.
DEADLINE_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its info string, its text (its fence's indentation removed), its marker."""

    page: Path
    line: int
    info: str
    code: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class Marker:
    """A parsed marker: its kind, the setup it names, the expected exit code and the kind's argument."""

    kind: str
    setup: str | None = None
    exit_code: int = 0
    argument: str = ""


def page_blocks(page: Path) -> Iterator[Block]:
    """The fenced blocks of one markdown page, in order, each with the marker on its last non-blank line before."""
    lines = page.read_text(encoding="utf-8").splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if opening is None:
            number += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = number + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[number + 1:end]]
        before = [line.strip() for line in lines[:number] if line.strip()]
        found = MARKER.match(before[-1]) if before else None
        yield Block(page, number + 1, opening["info"], "\n".join(body) + "\n", found[1] if found else None)
        number = end + 1


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def parse_marker(text: str) -> Marker:
    """The marker's meaning; ValueError when it is not one of the kinds above or misses its argument."""
    if text.startswith("not run:"):
        reason = text.removeprefix("not run:").strip()
        if not reason:
            raise ValueError("'not run:' gives no reason")
        return Marker("not run", argument=reason)
    kind, _, rest = text.partition(" ")
    if kind.startswith("run"):
        command = text.removeprefix("run").strip()
        if command and not command.startswith(":"):
            raise ValueError(f"'run' takes ': python FILE ARGS [expect=TEXT]; ...', not {command!r}")
        marker = Marker("run", argument=command.removeprefix(":").strip())
        run_commands(marker)
        return marker
    words = rest.split()
    if kind == "tested-by":
        if len(words) != 1:
            raise ValueError("'tested-by' names one test file")
        return Marker(kind, argument=words[0])
    if kind not in ("fragment", "cli", "output", "shape"):
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    exit_code, names = 0, []
    for word in words:
        if word.startswith("exit="):
            if kind != "cli":
                raise ValueError(f"'exit=' is for cli blocks; a {kind} block must exit 0")
            exit_code = int(word.removeprefix("exit="))
        else:
            names.append(word)
    if len(names) > 1:
        raise ValueError(f"{kind!r} names one setup, not {names}")
    setup = names[0] if names else None
    if setup is None and kind in ("fragment", "shape"):
        raise ValueError(f"{kind!r} needs a setup: one of {sorted(SETUPS)}")
    if setup is not None and setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; known: {sorted(SETUPS)}")
    return Marker(kind, setup, exit_code)


@dataclass(frozen=True)
class RunCommand:
    """One command line of a ``run`` marker: its words and the texts its output must contain."""

    argv: list[str]
    expect: list[str]


def run_commands(marker: Marker) -> list[RunCommand]:
    """The command lines of a ``run`` marker (``python example.py`` when it names none); ValueError when one is not
    ``python FILE ARGS`` or its quoting is broken. ``expect="TEXT"`` (shell quoting) is taken out of the line."""
    commands = []
    for line in marker.argument.split(";") if marker.argument else ["python example.py"]:
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise ValueError(f"'run' command {line.strip()!r}: {exc}") from None
        argv = [word for word in words if not word.startswith("expect=")]
        expect = [word.removeprefix("expect=") for word in words if word.startswith("expect=")]
        if len(argv) < 2 or argv[0] != "python" or not all(expect):
            raise ValueError(f"'run' command {line.strip()!r} is not 'python FILE ARGS [expect=TEXT]'")
        commands.append(RunCommand(argv, expect))
    return commands


# --- setups: the state a fragment or a command assumes ---------------------------------------------------


@dataclass
class Workspace:
    """Where one block runs: its working directory and, when it uses S3, the server and its fresh bucket."""

    directory: Path
    s3: Any = None
    bucket: str | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.s3.storage_options

    def localise(self, text: str) -> str:
        """The page's placeholders replaced with this run's paths and endpoint."""
        text = text.replace("/nvme/ckpt/", f"{self.directory}/nvme/ckpt/")
        if self.s3 is not None:
            text = text.replace("s3://bucket/", f"s3://{self.bucket}/").replace("http://minio:9000",
                                                                                self.s3.endpoint_url)
        return text

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("CKPTD_", "AWS_"))}
        env.update(CKPTD_DAEMON="off", CKPTD_DATA_CACHE_DIR=str(self.directory / ".data-cache"),
                   OMP_NUM_THREADS="1", COLUMNS="200")
        if self.s3 is not None:
            env.update(CKPTD_S3_ENDPOINT_URL=self.s3.endpoint_url, AWS_ACCESS_KEY_ID="testing",
                       AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        return env


@dataclass(frozen=True)
class Setup:
    """What a block assumes. ``prepare`` makes files in the workspace (in this process); a fragment's script is
    ``top`` (module level: imports, classes; also run by processes that ``spawn`` re-imports), then, under
    ``if __name__ == "__main__":``, ``before``, the block and ``after`` (which checks what the block did).
    ``marks`` go to the block's test (the framework setups belong to the integrations group)."""

    prepare: Callable[[Workspace, pytest.FixtureRequest], Any] | None = None
    top: str = ""
    before: str = ""
    after: str = ""
    marks: tuple[Any, ...] = ()
    #: Processes of the job the script runs in (more than one: torchrun's, on one node).
    ranks: int = 1


def _tokens(directory: Path) -> None:
    """nanoGPT's layout: ``data/openwebtext/{train,val}.bin``, uint16 token ids (8 windows of 1025 in train)."""
    import numpy as np

    data = directory / "data" / "openwebtext"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 64, size=8 * 1025 + 7, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 64, size=2 * 1025, dtype=np.uint16).tofile(data / "val.bin")


def _nanogpt_dataset(ws: Workspace, request: pytest.FixtureRequest) -> None:
    import ckptd

    _tokens(ws.directory)
    found = ckptd.index_dataset(str(ws.directory / "data" / "openwebtext"), "tokens",
                                reader_options={"seq_len": 1025}, include=("train*",))
    ckptd.save_dataset_manifest(found.manifest, ws.directory / "train.json")


def _jsonl_dataset(ws: Workspace, request: pytest.FixtureRequest) -> None:
    """``manifest.json``: 512 JSON-lines samples ``{"x", "y"}`` in 2 shards."""
    import ckptd

    data = ws.directory / "data"
    data.mkdir()
    for shard in range(2):
        xs = [(i % 17) / 16 for i in range(shard * 256, (shard + 1) * 256)]
        rows = (json.dumps({"x": x, "y": 2 * x - 1}) for x in xs)
        (data / f"shard-{shard}.jsonl").write_text("\n".join(rows) + "\n")
    ckptd.save_dataset_manifest(ckptd.index_dataset(str(data), "jsonl").manifest, ws.directory / "manifest.json")


def _committed_root(ws: Workspace, request: pytest.FixtureRequest) -> None:
    shutil.copytree(request.getfixturevalue("committed_root"), ws.directory / "ckpt")


def _export_source(ws: Workspace, request: pytest.FixtureRequest) -> None:
    """Step 5000 of ``{"model", "optim"}`` in ``/nvme/ckpt/run1``, promoted to ``s3://bucket/run1``; a config."""
    import torch

    import ckptd

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    manager = ckptd.CheckpointManager(ws.localise("/nvme/ckpt/run1"), remote=ws.localise("s3://bucket/run1"),
                                      storage_options=ws.storage_options, daemon="off")
    try:
        manager.save(5000, state, force=True)
    finally:
        manager.close()
    (ws.directory / "config.json").write_text(json.dumps({"model_type": "mlp", "hidden_size": 4}))


def _set_aside_record(ws: Workspace, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The record of step 3 set aside by a restore that found a flipped bit in it and went back to step 2."""
    import torch

    import ckptd

    root = ws.directory / "ckpt"
    state = {"weights": torch.arange(4096, dtype=torch.float32)}
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(every_steps=1), daemon="off")
    try:
        manager.save(2, state, durable=True)
        manager.save(3, state, durable=True)
    finally:
        manager.close()
    data = next((root / "step-000000000003").glob("*.data"))
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    data.write_bytes(bytes(damaged))
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(every_steps=1), daemon="off")
    try:
        assert manager.restore(state) == 2
    finally:
        manager.close()
    records = list((root / ".set-aside").glob("*.json"))
    assert len(records) == 1, records
    return json.loads(records[0].read_text())


SETUPS: dict[str, Setup] = {
    # a root whose steps `ckptd ls/verify/inspect` read
    "committed-root": Setup(prepare=_committed_root),
    # nanoGPT's token files, not yet indexed
    "openwebtext": Setup(prepare=lambda ws, request: _tokens(ws.directory)),
    # a nanoGPT-like script around data-loader.md's loop: train.json indexed, a model taking (X, Y), a manager
    "nanogpt": Setup(
        prepare=_nanogpt_dataset,
        top="import torch\nimport ckptd\n",
        before=textwrap.dedent("""\
            class GPT(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.embed, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

                def forward(self, idx, targets):
                    logits = self.head(self.embed(idx))
                    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

            batch_size, world_size, max_iters, gradient_accumulation_steps = 2, 1, 6, 2
            model = GPT()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            manager = ckptd.CheckpointManager("out", policy=ckptd.Policy(every_steps=2))
            """),
        after=textwrap.dedent("""\
            manager.close()
            assert iter_num == max_iters and X is None, (iter_num, X)
            assert manager.last_commit.step == 4, manager.last_commit
            """)),
    # a state dict of tensors for plain DCP in one process
    "dcp": Setup(
        top="import torch\n",
        before="state_dict = state = {'model': torch.nn.Linear(4, 2).state_dict()}\n",
        after="import os\nassert os.path.isdir(os.path.join('nvme', 'ckpt', 'run1', 'step-000000000100'))\n"),
    # torchtitan's shape: a process group (one gloo rank), an AppState, a step and a loader's state as bytes
    "dcp-process-group": Setup(
        top=textwrap.dedent("""\
            import io
            import socket

            import torch
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            from torch.distributed.checkpoint.stateful import Stateful


            class AppState(Stateful):
                def __init__(self, model, optimizer):
                    self.model, self.optimizer = model, optimizer

                def state_dict(self):
                    model, optim = get_state_dict(self.model, self.optimizer)
                    return {"model": model, "optim": optim}

                def load_state_dict(self, state):
                    set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"])
            """),
        before=textwrap.dedent("""\
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                port = free.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.ones(3, 4)).sum().backward()
            optimizer.step()
            step, loader_state = 7, b"the loader's position"
            """),
        after=textwrap.dedent("""\
            assert state["train"]["step"] == step and state["train"]["loader"].getvalue() == loader_state
            import os
            assert sorted(os.listdir(os.path.join("nvme", "ckpt", "run1"))) == [
                "step-000000000007", "step-000000000008", "step-000000000009"], os.listdir("nvme/ckpt/run1")
            dist.destroy_process_group()
            """)),
    # a manager that has committed step 1 and saves every step
    "manager": Setup(
        top="import torch\nimport ckptd\n",
        before=textwrap.dedent("""\
            manager = ckptd.CheckpointManager("ckpt", policy=ckptd.Policy(every_steps=1))
            state = {"model": torch.nn.Linear(4, 2)}
            manager.save(1, state, durable=True)
            step = 2
            """),
        after="assert record.step in (1, 2) and record.seconds >= 0, record\nmanager.close()\n"),
    # training-loop.md's loop: a model, an optimizer and a train_step; manifest.json of 512 samples
    "training-loop": Setup(
        prepare=_jsonl_dataset,
        top="import torch\n",
        before=textwrap.dedent("""\
            model = torch.nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

            def train_step(batch):
                loss = torch.nn.functional.mse_loss(model(batch["x"].float()[:, None])[:, 0], batch["y"].float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """),
        after="assert step == 2, step\n"),
    # a root whose step 5 holds a GPT's config, weights, optimizer and loader, and the code that built them
    "config-first": Setup(
        prepare=_jsonl_dataset,
        top=textwrap.dedent("""\
            from dataclasses import asdict, dataclass

            import torch
            import ckptd


            @dataclass
            class GPTConfig:
                n_embd: int = 8
                vocab_size: int = 16


            class GPT(torch.nn.Module):
                def __init__(self, config):
                    super().__init__()
                    self.embed = torch.nn.Embedding(config.vocab_size, config.n_embd)


            def make_optimizer(model):
                return torch.optim.AdamW(model.parameters(), lr=1e-3)
            """),
        before=textwrap.dedent("""\
            loader = ckptd.ShardLoader(ckptd.ShardDataset("manifest.json", global_batch_size=4, seed=1))
            saved = GPT(GPTConfig(n_embd=6))
            earlier = {"config": asdict(GPTConfig(n_embd=6)), "model": saved, "optim": make_optimizer(saved),
                       "data": ckptd.ShardLoader(loader.dataset, start_step=5)}
            first = ckptd.CheckpointManager("ckpt")
            first.save(5, earlier, durable=True)
            first.close()
            manager = ckptd.CheckpointManager("ckpt")
            """),
        after=textwrap.dedent("""\
            assert step == 5 and state["config"] == {"n_embd": 6, "vocab_size": 16}, (step, state)
            assert torch.equal(model.embed.weight, saved.embed.weight)
            manager.close()
            """)),
    # frameworks.md (the integrations group): a LightningModule and a data module; Lightning's PL_TRAINER_*
    # defaults stop the page's Trainer after 500 steps, at its first checkpoint
    "lightning": Setup(
        top=textwrap.dedent("""\
            import os

            import lightning as L
            import torch
            from lightning.pytorch.callbacks import ModelCheckpoint
            from torch.utils.data import DataLoader, TensorDataset


            class Regression(L.LightningModule):
                def __init__(self):
                    super().__init__()
                    self.net = torch.nn.Linear(4, 1)

                def training_step(self, batch, batch_index):
                    inputs, targets = batch
                    return torch.nn.functional.mse_loss(self.net(inputs), targets)

                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.01)


            class Data(L.LightningDataModule):
                def train_dataloader(self):
                    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
                    return DataLoader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)), batch_size=8)
            """),
        before=textwrap.dedent("""\
            os.environ.update(PL_TRAINER_MAX_EPOCHS="500", PL_TRAINER_ENABLE_PROGRESS_BAR="0",
                              PL_TRAINER_LOGGER="0", PL_TRAINER_ENABLE_MODEL_SUMMARY="0")
            model, data = Regression(), Data()
            """),
        after="assert trainer.global_step == 500 and 'step-000000000500' in os.listdir('/nvme/ckpt/run1')\n",
        marks=(pytest.mark.integrations,)),
    # frameworks.md: a one-layer GPT-2 built from a config, 16 samples, 4 steps with a save every 2
    "hf-trainer": Setup(
        top=textwrap.dedent("""\
            import os

            import torch
            from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


            class Samples(torch.utils.data.Dataset):
                def __len__(self):
                    return 16

                def __getitem__(self, index):
                    ids = torch.arange(8).add_(index).remainder_(32)
                    return {"input_ids": ids, "labels": ids.clone()}
            """),
        before=textwrap.dedent("""\
            model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1))
            args = TrainingArguments(output_dir="out", max_steps=4, save_steps=2, per_device_train_batch_size=4,
                                     report_to=[], use_cpu=True)
            dataset = Samples()
            """),
        after=textwrap.dedent("""\
            assert trainer.state.global_step == 4, trainer.state
            assert {"step-000000000002", "step-000000000004"} <= set(os.listdir("/nvme/ckpt/run1"))
            """),
        marks=(pytest.mark.integrations,)),
    # frameworks.md: an Accelerator on CPU, a model, optimizer, loader and scheduler, and a progress counter at
    # step 100 (the step the page restores)
    "accelerate": Setup(
        top=textwrap.dedent("""\
            import torch
            from accelerate import Accelerator
            from torch.utils.data import DataLoader, TensorDataset


            class Progress:
                def __init__(self):
                    self.step = 100

                def state_dict(self):
                    return {"step": self.step}

                def load_state_dict(self, state):
                    self.step = state["step"]
            """),
        before=textwrap.dedent("""\
            accelerator = Accelerator(cpu=True)
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
            progress = Progress()
            """),
        after="assert progress.step == 100\nhooks.close()\n",
        marks=(pytest.mark.integrations,)),
    # layouts.md: the job the mesh describes, 8 gloo ranks on this machine (slow: 8 interpreters with torch)
    "eight-ranks": Setup(
        top="import torch.distributed as dist\nimport ckptd\n",
        before='dist.init_process_group("gloo")\n',
        after=textwrap.dedent("""\
            assert mgr.world_size == 8 and mgr.rank == dist.get_rank()
            mgr.close()
            dist.destroy_process_group()
            """),
        marks=(pytest.mark.slow, pytest.mark.multirank), ranks=8),
    # export.md: step 5000 of a small model in /nvme/ckpt/run1 and on S3, and its config.json
    "export": Setup(prepare=_export_source),
    # cli.md: the record a restore writes beside a step it set aside for bad bytes
    "set-aside-record": Setup(prepare=_set_aside_record),
}


# --- collection -------------------------------------------------------------------------------------------


BLOCKS = all_blocks()


def _marker(block: Block) -> Marker | None:
    try:
        return parse_marker(block.marker) if block.marker is not None else None
    except ValueError:
        return None


def _runnable() -> list[Any]:
    params = []
    for block in BLOCKS:
        marker = _marker(block)
        if marker is None or marker.kind in ("tested-by", "not run"):
            continue
        marks = SETUPS[marker.setup].marks if marker.setup else ()
        params.append(pytest.param(block, marker, id=block.where, marks=marks))
    return params


def test_the_pages_hold_the_blocks_this_test_knows_of() -> None:
    assert len(BLOCKS) >= 20, [block.where for block in BLOCKS]
    assert {"README.md", "index.md", "training-loop.md"} <= {block.page.name for block in BLOCKS}


def test_every_block_is_marked_as_run_or_not_with_a_known_marker() -> None:
    problems = []
    for block in BLOCKS:
        if block.marker is None:
            problems.append(f"{block.where}: no <!-- example: ... --> marker before the block")
            continue
        try:
            parse_marker(block.marker)
        except ValueError as exc:
            problems.append(f"{block.where}: {exc}")
    assert not problems, "\n".join(problems)


def test_the_marker_parser_refuses_unknown_kinds_setups_and_reasonless_skips() -> None:
    for text in ("runs", "frag nanogpt", "fragment", "fragment no-such-setup", "not run:", "tested-by", "cli a b",
                 "fragment manager exit=1", "cli exit=x"):
        with pytest.raises(ValueError):
            parse_marker(text)
    assert parse_marker("cli committed-root exit=4") == Marker("cli", "committed-root", 4)
    assert parse_marker("run: python t.py 1") == Marker("run", argument="python t.py 1")
    for text in ("run: t.py 1", "run: python t.py expect=", "run: python t.py expect=\"open quote", "run python t.py"):
        with pytest.raises(ValueError):
            parse_marker(text)
    commands = run_commands(parse_marker('run: python t.py a 3 expect="after step 3" expect=done; python t.py b'))
    assert commands == [RunCommand(["python", "t.py", "a", "3"], ["after step 3", "done"]),
                        RunCommand(["python", "t.py", "b"], [])]
    assert run_commands(parse_marker("run")) == [RunCommand(["python", "example.py"], [])]


def test_the_block_reader_takes_the_marker_from_the_last_line_before_the_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        # A page

        <!-- example: cli -->

        ```bash
        ckptd ls ckpt
        ```

        - an item:

            <!-- example: fragment manager -->

            ```python
            manager.save(1, state)
            ```

        ```
        unmarked
        ```
        """))
    cli, fragment, unmarked = page_blocks(page)
    assert (cli.line, cli.info, cli.marker, cli.code) == (5, "bash", "cli", "ckptd ls ckpt\n")
    assert (fragment.marker, fragment.code) == ("fragment manager", "manager.save(1, state)\n")
    assert unmarked.marker is None and unmarked.info == ""


def test_the_output_check_compares_labels_and_table_cells_but_not_numbers() -> None:
    printed = "model: 70 B parameters\n┃ tier ┃ stall ┃ every ┃\n│ local │ 0.52 s │ 7.17 min │\n"
    assert _printed_like(["model: 13 B parameters", " tier | every", " local | 9 s | 1 min", "abridged"], printed) == 3
    with pytest.raises(AssertionError, match="layout"):
        _printed_like(["layout: tp 8"], printed)
    with pytest.raises(AssertionError, match="cells"):
        _printed_like([" object | 1 s"], printed)


def test_the_shape_check_compares_keys_not_values() -> None:
    _same_shape({"step": 3, "problems": [{"file": "a"}]}, {"step": 4, "problems": [{"file": "b"}, {"file": "c"}]})
    with pytest.raises(AssertionError, match=r"\$\.problems\[0\]"):
        _same_shape({"problems": [{"file": "a", "chunk": "b"}]}, {"problems": [{"file": "a"}]})


@pytest.mark.parametrize("block", [block for block in BLOCKS if (_marker(block) or Marker("")).kind == "tested-by"],
                         ids=lambda block: block.where)
def test_a_tested_by_marker_names_a_test_that_reads_the_page(block: Block) -> None:
    target = REPO / parse_marker(block.marker or "").argument
    assert target.is_file() and target.parts[len(REPO.parts)] == "tests", f"{block.where}: no test file {target}"
    assert block.page.name in target.read_text(encoding="utf-8"), \
        f"{block.where}: {target.relative_to(REPO)} does not mention {block.page.name}"


# --- running ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def committed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root holding committed steps 10 and 20 of a small model, made by CheckpointManager."""
    import torch

    import ckptd

    root = tmp_path_factory.mktemp("docs-examples") / "ckpt"
    model = torch.nn.Linear(16, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "config": {"width": 16}}
    manager = ckptd.CheckpointManager(root, policy=ckptd.Policy(every_steps=10), daemon="off")
    try:
        for step in range(1, 21):
            manager.save(step, state)
    finally:
        manager.close()
    return root


def _workspace(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> Workspace:
    ws = Workspace(tmp_path)
    if "s3://" in block.code or "minio" in block.code:
        ws.s3 = request.getfixturevalue("s3_server")
        ws.bucket = f"docs-{uuid.uuid4().hex[:12]}"
        ws.s3.create_bucket(ws.bucket)
    return ws


def _run(argv: list[str], ws: Workspace, what: str, expected: int = 0) -> str:
    """Run ``argv`` in the workspace in a session of its own; after :data:`DEADLINE_S` (or when the test is
    interrupted) the whole process group is killed: the ranks, DataLoader workers and fork servers it started
    with it. Returns its stdout."""
    process = subprocess.Popen(argv, cwd=ws.directory, env=ws.environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{what} still ran after {DEADLINE_S} s (killed):\n{(stdout + stderr)[-6000:]}") from None
    except BaseException:
        _kill_group(process)
        process.communicate()
        raise
    output = stdout + stderr
    assert process.returncode == expected, f"{what} exited {process.returncode}, not {expected}:\n{output[-6000:]}"
    return stdout


def _kill_group(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _script(block: Block, setup: Setup, ws: Workspace) -> str:
    main = ws.localise(setup.before + block.code + setup.after)
    return f"{setup.top}\nif __name__ == '__main__':\n{textwrap.indent(main, '    ')}\n"


def _command_lines(text: str) -> list[str]:
    """The block's lines with backslash continuations joined, blank and comment-only lines dropped."""
    joined = text.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _ckptd(line: str, ws: Workspace, where: str) -> list[str]:
    assert CKPTD.is_file(), f"no ckptd entry point beside {sys.executable}: pip install -e ."
    argv = shlex.split(ws.localise(line), comments=True)
    assert argv and argv[0] == "ckptd", f"{where}: a cli block shows ckptd commands only, not {line!r}"
    return [str(CKPTD), *argv[1:]]


def _cells(line: str) -> list[str]:
    masked = re.sub(r"\d+(?:\.\d+)?", "N", line)
    return [cell.strip() for cell in re.split(r"[|│┃]", masked) if cell.strip()]


def _printed_like(shown: list[str], printed: str) -> int:
    """Asserts that each labelled line (``label: ...``) and each table row shown has a printed counterpart (the
    same label; the row's cells, numbers masked, in order within a printed row); returns how many it checked."""
    rows = [_cells(line) for line in printed.splitlines()]
    checked = 0
    for line in shown:
        if "|" in line:
            cells = _cells(line)
            assert any(_in_order(cells, row) for row in rows), f"no printed row has the cells {cells}:\n{printed}"
        elif (label := re.match(r"^([a-z][\w -]*):", line)) is not None:
            assert re.search(rf"^{re.escape(label[1])}:", printed, re.MULTILINE), \
                f"no printed line starts with {label[1]!r}:\n{printed}"
        else:
            continue
        checked += 1
    return checked


def _in_order(wanted: list[str], row: list[str]) -> bool:
    remaining = iter(row)
    return all(cell in remaining for cell in wanted)


def _same_shape(shown: Any, made: Any, path: str = "$") -> None:
    if isinstance(shown, dict):
        assert isinstance(made, dict) and set(shown) == set(made), f"{path}: keys {sorted(shown)} vs {made}"
        for key in shown:
            _same_shape(shown[key], made[key], f"{path}.{key}")
    elif isinstance(shown, list):
        assert isinstance(made, list) and made, f"{path}: a list shown, {made!r} made"
        _same_shape(shown[0], made[0], f"{path}[0]")


@pytest.mark.parametrize(("block", "marker"), _runnable())
def test_example(block: Block, marker: Marker, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    ws = _workspace(block, tmp_path, request)
    setup = SETUPS[marker.setup] if marker.setup else Setup()
    prepared = setup.prepare(ws, request) if setup.prepare else None
    if marker.kind == "run":
        for command in run_commands(marker):
            script = ws.directory / command.argv[1]
            script.write_text(ws.localise(block.code))
            what = f"{block.where}: {' '.join(command.argv)}"
            printed = _run([sys.executable, *command.argv[1:]], ws, what)
            missing = [text for text in command.expect if text not in printed]
            assert not missing, f"{what} did not print {missing}:\n{printed[-6000:]}"
    elif marker.kind == "fragment":
        script = ws.directory / "example.py"
        script.write_text(_script(block, setup, ws))
        launcher = [] if setup.ranks == 1 else ["-m", "torch.distributed.run", "--standalone",
                                                "--nproc-per-node", str(setup.ranks)]
        _run([sys.executable, *launcher, str(script)], ws, f"{block.where} (setup {marker.setup})")
    elif marker.kind == "cli":
        lines = _command_lines(block.code)
        assert lines, f"{block.where}: no command in the block"
        for line in lines:
            _run(_ckptd(line, ws, block.where), ws, f"{block.where}: {line}", marker.exit_code)
    elif marker.kind == "output":
        commands = [index for index, line in enumerate(block.code.splitlines()) if line.startswith("$ ")]
        assert commands, f"{block.where}: an output block starts its commands with '$ '"
        lines = block.code.splitlines()
        for at, start in enumerate(commands):
            shown = lines[start + 1:commands[at + 1] if at + 1 < len(commands) else len(lines)]
            printed = _run(_ckptd(lines[start][2:], ws, block.where), ws, f"{block.where}: {lines[start]}")
            assert _printed_like(shown, printed) > 0, f"{block.where}: no labelled line or table row to compare"
    else:  # shape
        _same_shape(json.loads(block.code), prepared)
