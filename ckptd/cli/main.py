"""The ``ckptd`` command line: one module per subcommand, registered on one click group.

A subcommand's module is imported only when that command runs, so ``ckptd --help`` (and each
command's ``--help``) starts without torch; a command imports what it needs inside its function.

Errors from :mod:`ckptd.errors` become one line on stderr and the error's exit code; set
``CKPTD_DEBUG=1`` to see the traceback instead.

Exit codes: 0 success, 1 generic ckptd error, 2 usage or configuration, 3 malformed format,
4 integrity failure, 5 commit failure, 6 storage unreachable or full, 7 directory locked,
8 not found, 9 state mismatch, 10 pickle refused, 11 plugin missing, 12 failure on some rank or in
background work, 13 a deadline passed.
"""

from __future__ import annotations

import importlib
import os

import click

from ckptd.errors import CkptdError

#: (module under ckptd.cli, attribute, one-line help) of every subcommand; each module holds one click
#: command. A module is imported only when its command runs (or its own ``--help`` is asked for), so
#: ``ckptd --help`` imports none of them; the help line is what ``ckptd --help`` shows (a test checks it
#: against the command's docstring). An entry without a help line is imported to list it.
_SUBCOMMANDS: tuple[tuple[str, ...], ...] = (
    ("ls_cmd", "ls", "List steps in PATHS (directories or s3:// URLs, nearest tier first) and their state on each."),
    ("verify_cmd", "verify", "Re-hash everything in PATH and report each bad file and chunk (exit 4 when any is bad)."),
    ("inspect_cmd", "inspect", "Show the manifest of a step, the values it saved and every tensor of each rank."),
    ("restore_cmd", "restore", "Export one step of PATH, verified, to a file usable without ckptd."),
    ("export_cmd", "export", "Export one step of PATH, verified, as a Hugging Face safetensors layout for "
                             "inference."),
    ("gc_cmd", "gc", "Apply retention and collect garbage in PATH (a directory or an s3:// URL)."),
    ("promote_cmd", "promote", "Promote the committed steps of the local checkpoint directory PATH to an object tier."),
    ("bench_cmd", "bench", "Measure save stall, durable throughput, restore and training slowdown against "
                           "torch.save and DCP."),
    ("data_cmd", "data", "Dataset manifests for the verified shard loader."),
    ("demo_cmd", "demo", "Run the crash-and-resume demo; exits 1 if the resumed run differs from the "
                         "uninterrupted one."),
    ("launch_cmd", "launch", "Start a training script on every rank of this node and restart only the rank "
                             "that fails."),
    ("status_cmd", "status", "Show the status document of this node's ckptd daemon (exit 3 when no daemon answers)."),
    ("plan_cmd", "plan", "Show what checkpointing a planned job costs: bytes per rank and node, times, storage, "
                         "intervals, lost time, and with a run length the failures, hours lost and bytes written over "
                         "the run, async against sync."),
    ("goodput_cmd", "goodput", "Simulate failures of a planned job: goodput, lost work and time to recover, ckptd "
                               "against restart-all, and the interval that maximises goodput."),
    ("daemon_cmd", "daemon", "Run the node daemon: promote, replicate, scrub and serve the committed steps of "
                             "local roots."),
    ("plugins_cmd", "plugins", "List installed plugins per entry-point group, the extra each needs and whether "
                               "it imports now."),
)


class _CkptdGroup(click.Group):
    """A click group that imports a subcommand's module on first use and turns ckptd errors into one
    line and an exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({entry[1] for entry in _SUBCOMMANDS} | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            for module_name, attribute, *_ in _SUBCOMMANDS:
                if attribute == cmd_name:
                    self.add_command(getattr(importlib.import_module(f"ckptd.cli.{module_name}"), attribute))
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        known = {entry[1]: entry[2] for entry in _SUBCOMMANDS if len(entry) > 2}
        rows = []
        for name in self.list_commands(ctx):
            if name in known and name not in self.commands:
                rows.append((name, known[name]))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=200)))
        if rows:
            limit = formatter.width - 6 - max(len(name) for name, _ in rows)
            with formatter.section("Commands"):
                formatter.write_dl([(name, _short(text, limit)) for name, text in rows])

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except CkptdError as error:
            if os.environ.get("CKPTD_DEBUG"):
                raise
            click.echo(f"ckptd: error: {error}", err=True)
            ctx.exit(error.exit_code)


def _short(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at a word boundary, as click shortens a command's help."""
    limit = max(limit, 20)
    if len(text) <= limit:
        return text
    return text[:limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:") + "..."


@click.group(cls=_CkptdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptd")
def cli() -> None:
    """ckptd: fault-tolerant checkpoints and verified data for PyTorch training."""


def main() -> None:
    """Console-script entry point."""
    cli.main(prog_name="ckptd")


if __name__ == "__main__":
    main()
