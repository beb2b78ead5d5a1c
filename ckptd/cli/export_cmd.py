"""``ckptd export``: one step as a Hugging Face safetensors layout, for inference tools."""

from __future__ import annotations

from pathlib import Path

import click

from ckptd.cli.options import byte_progress, json_option, open_cli_tier, print_json, s3_options


@click.command("export")
@click.argument("paths", metavar="PATH...", nargs=-1, required=True)
@click.option("--step", type=int, required=True, help="The step to export.")
@click.option("--format", "fmt", type=click.Choice(["safetensors"]), default="safetensors", show_default=True,
              help="Output format.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory to create (must not exist or be empty; default: ./export-step-<STEP>).")
@click.option("--consolidate", is_flag=True,
              help="Assemble tensors sharded over ranks (FSDP2/DTensor, DCP) into full tensors; without it a "
                   "sharded tensor is refused.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"], case_sensitive=False), default=None,
              help="Cast floating tensors (float8 ones excepted) to this dtype.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest output file (5GB = 5*10^9 bytes, 2GiB = 2*2^30); a larger model is split into "
                   "model-0000x-of-0000y.safetensors files and model.safetensors.index.json.")
@click.option("--key-prefix", "--prefix", "key_prefix", default=None,
              help="Export only the keys under this prefix, stripped (e.g. 'model.' picks the model out of "
                   "{'model': ..., 'optim': ...}).")
@click.option("--exclude", "exclude", multiple=True, metavar="PREFIX",
              help="Leave out the keys under this prefix (repeatable; full keys, e.g. --exclude optimizer "
                   "--exclude train_state when the model's keys sit at the top level).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A model config.json to copy in, so that transformers' from_pretrained loads the directory.")
@click.option("--dry-run", is_flag=True, help="Check and plan the export, print the planned files, write nothing.")
@json_option
@s3_options
def export(paths: tuple[str, ...], step: int, fmt: str, out: Path | None, consolidate: bool, dtype: str | None,
           max_shard_size: str, key_prefix: str | None, exclude: tuple[str, ...], config_file: Path | None,
           dry_run: bool, as_json: bool,
           endpoint_url: str | None, region: str | None) -> None:
    """Export one step of PATH, verified, as a Hugging Face safetensors layout for inference.

    PATH is a checkpoint root (a directory or an s3:// URL); several are tried nearest first, chunk by
    chunk. Every chunk is verified against its digest as it is read; the output directory appears only
    when the whole export succeeded.
    """
    from ckptd.export import ExportOptions, plan_export, write_export

    target = out if out is not None else Path(f"export-step-{step}")
    options = ExportOptions(consolidate=consolidate, dtype=dtype, max_shard_size=max_shard_size,
                            key_prefix=key_prefix, exclude=exclude, config_file=config_file)
    tiers = [open_cli_tier(path, endpoint_url, region) for path in paths]
    try:
        plan = plan_export(tiers, step, target, options)
        if dry_run:
            files = {shard.name: [slot.key for slot in shard.slots] for shard in plan.shards}
            if as_json:
                print_json({"step": plan.step, "out": str(target), "total_size": plan.total_size,
                            "files": files})
            else:
                for name, keys in files.items():
                    click.echo(f"{name}: {len(keys)} tensors")
                click.echo(f"would write {plan.total_size} bytes of step {plan.step} to {target}")
            return
        with byte_progress(f"exporting step {step}", plan.total_size, enabled=not as_json) as advance:
            report = write_export(plan, progress=advance)
    finally:
        for tier in tiers:
            tier.close()
    if as_json:
        print_json(report.to_json())
    else:
        rate = report.total_size / max(report.seconds, 1e-9) / 1e6
        click.echo(f"wrote step {report.step} ({report.tensors} tensors, {report.total_size} bytes, verified) "
                   f"to {report.out} as {fmt}: {', '.join(report.files)} ({report.seconds:.1f} s, {rate:.0f} MB/s)")
