"""``ckptd gc``: retention and garbage collection on a local directory or an object tier.

``--keep N`` deletes committed steps older than the newest N; without it no committed step is
deleted. Abandoned uncommitted steps (crashed saves or promotions) are removed on both tiers; on the
object tier, chunks no retained or in-flight step references are deleted (mark and sweep) and stale
multipart uploads are aborted. ``--remove-set-aside`` (local directory only) also deletes the steps a
restore set aside in ``.set-aside/`` with their records, after which ``ckptd verify`` no longer fails on
them. ``--dry-run`` only reports. Exit 7 when another GC holds the lease; 2 when PATH is a file or a folder
inside a root, or ``--remove-set-aside`` is given an object tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckptd.cli.options import json_option, print_json, s3_options
from ckptd.cli.roots import open_root
from ckptd.policy import KeepLatest

if TYPE_CHECKING:
    from ckptd.promotion.gc import GcReport


def _describe(report: GcReport) -> list[str]:
    verb = "would delete" if report.dry_run else "deleted"
    lines = [f"{report.tier}: kept steps {list(report.kept_steps) or 'none'}",
             f"{verb} steps {list(report.deleted_steps) or 'none'} (retention), "
             f"{list(report.abandoned_steps) or 'none'} (abandoned)"]
    if report.in_flight_steps:
        lines.append(f"left alone in-flight steps {list(report.in_flight_steps)}")
    if report.tier.startswith("object"):
        lines.append(f"{verb} {report.deleted_chunks} unreferenced chunk(s), {report.deleted_chunk_bytes} bytes; "
                     f"{'would abort' if report.dry_run else 'aborted'} {report.aborted_uploads} stale upload(s)")
    if report.note:
        lines.append(report.note)
    return lines


@click.command("gc")
@click.argument("path")
@click.option("--keep", type=click.IntRange(min=1), default=None, envvar="CKPTD_GC_KEEP",
              help="Keep the newest N committed steps, delete older ones. [env: CKPTD_GC_KEEP]")
@click.option("--abandoned-after", type=click.FloatRange(min=0), default=None, envvar="CKPTD_GC_ABANDONED_S",
              metavar="SECONDS", help="Age after which an uncommitted step or upload is abandoned "
              "(default 3600). [env: CKPTD_GC_ABANDONED_S]")
@click.option("--remove-set-aside", is_flag=True,
              help="Also delete the steps a restore set aside (.set-aside/ of a local directory) and their records; "
                   "`ckptd ls` shows them and why first.")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted, delete nothing.")
@s3_options
@json_option
def gc(path: str, keep: int | None, abandoned_after: float | None, remove_set_aside: bool, dry_run: bool,
       endpoint_url: str | None, region: str | None, as_json: bool) -> None:
    """Apply retention and collect garbage in PATH (a directory or an s3:// URL).

    \b
    Exit status: 0 done; 7 another GC holds the lease; 2 PATH is a file or a folder inside a root, or
    --remove-set-aside was given an object tier."""
    from ckptd.manager.set_aside import remove_set_aside as remove_set_aside_steps
    from ckptd.promotion.gc import collect_garbage
    from ckptd.tiers.local import LocalTier

    tier = open_root(path, endpoint_url, region)
    try:
        if remove_set_aside and not isinstance(tier, LocalTier):
            raise click.UsageError("--remove-set-aside works on a local directory: only a restore there sets "
                                   "steps aside")
        report = collect_garbage(tier, retention=KeepLatest(keep) if keep is not None else None,
                                 dry_run=dry_run, abandoned_after_s=abandoned_after)
        removed = remove_set_aside_steps(tier.root, dry_run=dry_run) if isinstance(tier, LocalTier) and \
            remove_set_aside else []
    finally:
        tier.close()
    if as_json:
        print_json({**report.to_json(), "set_aside_removed": [
            {"step": record.step, "name": record.name, "reason": record.reason} for record in removed]})
    else:
        for line in _describe(report):
            click.echo(line)
        if remove_set_aside:
            verb = "would delete" if dry_run else "deleted"
            click.echo(f"{verb} set-aside steps {[record.step for record in removed] or 'none'}"
                       + "".join(f"\n  {record.name}: {record.reason}" for record in removed))
