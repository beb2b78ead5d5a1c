"""The ``ckptd`` command line: one module per subcommand, registered on one click group.

Errors from :mod:`ckptd.errors` become one line on stderr and the error's exit code; set
``CKPTD_DEBUG=1`` to see the traceback instead.

Exit codes: 0 success, 1 generic ckptd error, 2 usage or configuration, 3 malformed format,
4 integrity failure, 5 commit failure, 6 storage unreachable or full, 7 directory locked,
8 not found, 9 state mismatch, 10 pickle refused, 11 plugin missing, 12 failure on some rank.
"""

from __future__ import annotations

import importlib
import os

import click

from ckptd.errors import CkptdError

#: (module under ckptd.cli, attribute) of every subcommand; each module holds one click command.
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("ls_cmd", "ls"),
    ("verify_cmd", "verify"),
    ("inspect_cmd", "inspect"),
    ("restore_cmd", "restore"),
    ("gc_cmd", "gc"),
    ("promote_cmd", "promote"),
    ("bench_cmd", "bench"),
    ("data_cmd", "data"),
    ("demo_cmd", "demo"),
)


class _CkptdGroup(click.Group):
    """A click group that turns ckptd errors into one line and an exit code."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except CkptdError as error:
            if os.environ.get("CKPTD_DEBUG"):
                raise
            click.echo(f"ckptd: error: {error}", err=True)
            ctx.exit(error.exit_code)


@click.group(cls=_CkptdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptd")
def cli() -> None:
    """ckptd: fault-tolerant checkpoints and verified data for PyTorch training."""


def _register() -> None:
    for module_name, attribute in _SUBCOMMANDS:
        cli.add_command(getattr(importlib.import_module(f"ckptd.cli.{module_name}"), attribute))


_register()


def main() -> None:
    """Console-script entry point."""
    cli.main(prog_name="ckptd")


if __name__ == "__main__":
    main()
