"""``ckptd verify``: re-hash every chunk of one or all committed steps; non-zero exit on any problem.

With ``--repair`` on an object tier, every object found bad (and every one recorded bad earlier, by a
restore or a promotion) is replaced with an intact copy from the local roots named by ``--from`` or
from the object tier itself (:mod:`ckptd.promotion.repair`), and the steps that had problems are
verified again: exit 0 when every step is intact afterwards.

Steps a restore set aside in a local root (``.set-aside/``) are reported with what the restore found
(file, chunk, tier, digests); one in which the restore found bad bytes (or that has no record of why)
makes ``verify`` fail until ``ckptd gc --remove-set-aside`` deletes it: evidence of corruption does not
disappear with the fallback. A step set aside only because another rank lacked it is listed, not failed.

Exit status: 0 every committed step intact and nothing corrupt set aside; 4 a bad file or chunk, or a
set-aside step with bad bytes; 2 PATH is a file or a folder inside a root (the message names the root to pass); 8 PATH holds no
ckptd checkpoint root, or ``--step`` names a step that is not there."""

from __future__ import annotations

import datetime
from dataclasses import asdict

import click

from ckptd.cli.options import byte_progress, json_option, print_json, s3_options
from ckptd.cli.roots import holds_root, open_root, set_aside_of
from ckptd.errors import CkptdError, IntegrityError, NotFoundError
from ckptd.format.layout import parse_step_dir
from ckptd.promotion.repair import RepairReport, repair_objects, repair_sources
from ckptd.stepio.step_reader import VerifyProblem, load_step_manifest, load_rank_index, verify_step
from ckptd.tiers import StorageTier
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.chunk_health import bad_chunk_paths, report_bad_chunk


def _step_bytes(tier: StorageTier, step: int) -> int:
    try:
        manifest = load_step_manifest(tier, step)
        held = ranks_held(tier, step, manifest)
        return sum(load_rank_index(tier, manifest, rank).data_size for rank in held)
    except CkptdError:
        return 0


def _verify(tier: StorageTier, steps: list[int], as_json: bool) -> tuple[list[VerifyProblem], int]:
    problems: list[VerifyProblem] = []
    checked = 0
    total = sum(_step_bytes(tier, s) for s in steps)
    with byte_progress(f"verifying {tier.label}", total, enabled=not as_json) as advance:
        for candidate in steps:
            if not tier.is_committed(candidate):
                continue
            problems.extend(verify_step(tier, candidate, progress=advance))
            checked += 1
    return problems, checked


def _mendable(tier: StorageTier, problem: VerifyProblem) -> bool:
    """Whether a problem is a bad chunk or pack object (not a manifest or index)."""
    if problem.path.startswith(tier.chunk_path("")):
        return True
    directory, _, name = problem.path.partition("/")
    return parse_step_dir(directory) == problem.step and not name.endswith(".json")


def _repair(tier: StorageTier, problems: list[VerifyProblem], sources: tuple[str, ...]) -> RepairReport:
    bad = {problem.path for problem in problems if _mendable(tier, problem)}
    for problem in problems:
        if problem.path in bad:
            report_bad_chunk(tier, problem.path, step=problem.step, reason=f"verify: {problem.error}")
    return repair_objects(tier, bad | bad_chunk_paths(tier), repair_sources(tier, sources))


@click.command("verify")
@click.argument("path")
@click.option("--step", type=int, default=None, help="Verify only this step (default: every committed step).")
@click.option("--repair", is_flag=True, envvar="CKPTD_VERIFY_REPAIR",
              help="Object tier: replace every bad chunk or pack with an intact copy (from --from roots or the "
                   "object tier itself), then verify again [env: CKPTD_VERIFY_REPAIR].")
@click.option("--from", "sources", multiple=True, metavar="LOCAL_ROOT",
              help="With --repair: a local checkpoint root to take intact copies from (its pinned steps too); "
                   "may be given several times.")
@s3_options
@json_option
def verify(path: str, step: int | None, repair: bool, sources: tuple[str, ...], endpoint_url: str | None,
           region: str | None, as_json: bool) -> None:
    """Re-hash everything in PATH and report each bad file and chunk (exit 4 when any is bad).

    Steps a restore set aside (.set-aside/ of a local root) are reported with file, chunk, tier and digests;
    those with bad bytes fail the verify until `ckptd gc PATH --remove-set-aside` deletes them.

    \b
    Exit status: 0 every committed step intact, nothing corrupt set aside; 4 a bad file or chunk, or a
    set-aside step with bad bytes;
    2 PATH is a file or a folder inside a root; 8 PATH holds no checkpoint root, or --step is not there."""
    tier = open_root(path, endpoint_url, region)
    report: RepairReport | None = None
    try:
        if repair and not tier.stores_chunks_by_digest:
            raise click.UsageError("--repair mends an object tier (s3://...); a bad local step is set aside by "
                                   "the next restore and saved again")
        if not holds_root(tier):
            raise NotFoundError(f"{path} holds no ckptd checkpoint root: nothing to verify", tier=tier.label,
                                hint="pass the directory given to CheckpointManager (holding step-* folders) or "
                                     "its s3:// URL")
        set_aside = [record for record in set_aside_of(tier) if step is None or record.step == step]
        steps = tier.list_step_numbers() if step is None else [step]
        if step is not None and step not in tier.list_step_numbers() and not set_aside:
            raise NotFoundError("no such step", step=step, tier=tier.label,
                                hint=f"committed steps there: {tier.committed_steps() or 'none'}")
        problems, checked = _verify(tier, steps, as_json)
        if repair:
            report = _repair(tier, problems, sources)
            if report.repaired:
                problems, checked = _verify(tier, steps, as_json)
    finally:
        tier.close()
    # A step set aside only because another rank lacked it (an elastic recovery) held no bad bytes: it is
    # listed, but only bad bytes, or a set-aside step nobody recorded a reason for, fail the check.
    alarming = [record for record in set_aside if record.corrupt or not record.recorded]
    if as_json:
        answer = {"tier": tier.label, "steps_checked": checked, "problems": [asdict(p) for p in problems],
                  "set_aside": [{**record.to_json(), "recorded": record.recorded, "needs_attention": record in alarming}
                                for record in set_aside]}
        if report is not None:
            answer["repaired"] = list(report.repaired)
            answer["unrepairable"] = [{"path": path, "why": why} for path, why in report.unrepairable]
            answer["intact"] = list(report.intact)
        print_json(answer)
    else:
        if report is not None:
            for repaired in report.repaired:
                click.echo(f"REPAIRED {repaired}")
            for intact in report.intact:
                click.echo(f"INTACT {intact}: recorded bad, but it verifies now; record cleared")
            for bad, why in report.unrepairable:
                click.echo(f"UNREPAIRABLE {bad}: {why}")
        for problem in problems:
            rank = "-" if problem.rank is None else problem.rank
            click.echo(f"BAD step {problem.step} rank {rank}: {problem.error}")
        for record in set_aside:
            when = datetime.datetime.fromtimestamp(record.set_aside_at, datetime.timezone.utc)
            label = "SET-ASIDE" if record in alarming else "SET-ASIDE (no bad bytes)"
            click.echo(f"{label} step {record.step} ({record.name}, {when:%Y-%m-%d %H:%M:%S} UTC): {record.reason}")
            for found in record.problems:
                click.echo(f"  {found.describe()}")
        verdict = ("all intact" if not set_aside else "every one intact") if not problems else \
            f"{len(problems)} problem(s)"
        if set_aside:
            verdict += (f"; {len(set_aside)} step(s) set aside by a restore: inspect them, then remove them with "
                        f"`ckptd gc {path} --remove-set-aside`")
        click.echo(f"{checked} committed step(s) checked on {tier.label}: {verdict}")
    if problems or alarming:
        raise click.exceptions.Exit(IntegrityError.exit_code)
