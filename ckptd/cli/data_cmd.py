"""``ckptd data``: dataset manifests for the verified shard loader.

``ckptd data index URI --format FORMAT --out manifest.json`` walks a local directory or object-store
prefix (or takes one file), hashes and scans every shard in parallel (with a progress bar), and writes
the manifest. ``--include``/``--exclude`` globs pick the shards (see :mod:`ckptd.data.selection`). When
``--out`` already holds a manifest of the same root and format, only shards whose size or storage
version changed are read again. ``ckptd data formats`` lists every registered format and its options.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ckptd.data.indexer import index_dataset, resolve_root
from ckptd.data.manifest import DatasetManifest, ShardRecord, load_dataset_manifest, save_dataset_manifest
from ckptd.data.registry import available_formats, reader_class
from ckptd.errors import ConfigError, CkptdError


def _parse_pairs(pairs: tuple[str, ...], what: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are read as JSON when they parse (numbers, true/false), else strings."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} {pair!r} is not KEY=VALUE")
        try:
            parsed[key] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[key] = raw
    return parsed


def storage_options_from(pairs: tuple[str, ...], endpoint_url: str | None) -> dict[str, Any]:
    """fsspec storage options from ``--storage-option`` pairs and ``--endpoint-url``."""
    options = _parse_pairs(pairs, "storage option")
    if endpoint_url:
        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs["endpoint_url"] = endpoint_url
        options["client_kwargs"] = client_kwargs
    return options


def _previous(out: str, root: str, fmt: str) -> DatasetManifest | None:
    if not os.path.exists(out):
        return None
    try:
        previous = load_dataset_manifest(out)
    except CkptdError:
        return None
    return previous if previous.root == root and previous.format == fmt else None


@click.group("data")
def data() -> None:
    """Dataset manifests for the verified shard loader."""


#: The built-in formats and their options, as ``ckptd data index --help`` shows them.
FORMATS_HELP = """\b
Formats (--format) and their options (--option KEY=VALUE):
  tokens      flat token-id arrays, nanoGPT/Megatron style: .bin (raw little-endian) or .npy (1-D)
              seq_len=N  required: tokens per sample. Samples are fixed, non-overlapping windows
                         tokens[i*N:(i+1)*N] of each file (not random offsets); tokens that do
                         not fill a last window are unused. For next-token training with
                         ShardDataset(split_targets=True) use N = block_size + 1: inputs and
                         targets are then [batch, block_size] int64 tensors.
              dtype=D    dtype of .bin files (default uint16, nanoGPT's; uint32 for vocabularies
                         over 65535); .npy files carry their own dtype
  jsonl       one JSON value per line (.jsonl, .ndjson); a sample is one decoded line. No options.
  webdataset  tar shards (.tar); a sample is {"__key__": key, ext: bytes, ...}. No options.
  parquet     .parquet files (needs pyarrow); a sample is one row as a dict. No options.
Plugins add formats: `ckptd data formats` lists every format with its options.

\b
Which files are shards:
  --include GLOB  only files matching a glob (the reader's file endings are then not used);
                  a glob without "/" matches the file name, with "/" the path under URI
  --exclude GLOB  leave out matching files
  Without either, a directory holding several splits (train.bin and val.bin) is refused
  rather than mixed into one manifest. A URI naming one file indexes that file alone.
"""


@data.command("index", epilog=FORMATS_HELP)
@click.argument("uri")
@click.option("--format", "fmt", required=True, help="Shard format: a registered reader "
              "(jsonl, tokens, webdataset, parquet, or a plugin's).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Manifest file to write.")
@click.option("--option", "reader_option", multiple=True, metavar="KEY=VALUE",
              help="Reader option, e.g. seq_len=2048 for tokens (every format's options are listed below). Repeatable.")
@click.option("--storage-option", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option (values parsed as JSON when possible). Repeatable.")
@click.option("--endpoint-url", envvar="CKPTD_DATA_ENDPOINT_URL", show_envvar=True,
              help="S3-compatible endpoint for s3:// URIs.")
@click.option("--suffix", multiple=True, help="Index files with this ending instead of the reader's own.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Index only files matching GLOB (file name, or path under URI if it holds '/'). Repeatable.")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave out files matching GLOB. Repeatable.")
@click.option("--threads", type=int, default=None, envvar="CKPTD_DATA_INDEX_THREADS", show_envvar=True,
              help="Shards read and hashed in parallel.")
@click.option("--full", is_flag=True, help="Re-hash every shard even if an existing --out lists it.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of text.")
def index(uri: str, fmt: str, out: str, reader_option: tuple[str, ...], storage_option: tuple[str, ...],
          endpoint_url: str | None, suffix: tuple[str, ...], include: tuple[str, ...], exclude: tuple[str, ...],
          threads: int | None, full: bool, as_json: bool) -> None:
    """Index the shards under URI (directory, fsspec URL, or one file) into a dataset manifest."""
    if fmt not in available_formats():
        raise ConfigError(f"unknown shard format {fmt!r}", hint=f"known: {', '.join(available_formats())}")
    storage_options = storage_options_from(storage_option, endpoint_url)
    if "://" not in uri:
        uri = os.path.abspath(uri)
    previous = None if full else _previous(out, resolve_root(uri, storage_options)[0], fmt)
    with Progress(TextColumn("[bold]indexing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), transient=True, disable=as_json) as progress:
        task = progress.add_task("", total=None)

        def report(record: ShardRecord, reused: bool, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total,
                            description=f"{'kept' if reused else 'hashed'} {record.path}")

        result = index_dataset(uri, fmt, reader_options=_parse_pairs(reader_option, "reader option"),
                               storage_options=storage_options, previous=previous,
                               suffixes=tuple(suffix) or None, include=include, exclude=exclude,
                               threads=threads, progress=report)
    save_dataset_manifest(result.manifest, out)
    summary = {"manifest": out, "shards": len(result.manifest.shards),
               "samples": result.manifest.total_samples, "bytes": result.manifest.total_bytes,
               "hashed": len(result.hashed), "reused": len(result.reused), "dropped": list(result.dropped),
               "manifest_digest": result.manifest.digest}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"indexed {summary['shards']} shard(s), {summary['samples']} samples, {summary['bytes']} "
                   f"bytes ({summary['hashed']} hashed, {summary['reused']} unchanged) -> {out}")


@data.command("formats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def formats(as_json: bool) -> None:
    """List the registered shard formats, their file endings and options."""
    listed = []
    for name in available_formats():
        try:
            reader = reader_class(name)
        except CkptdError as error:
            listed.append({"format": name, "error": str(error)})
            continue
        listed.append({"format": name, "suffixes": list(reader.suffixes),
                       "options": {key: kind.__name__ for key, kind in reader.option_types.items()}})
    if as_json:
        click.echo(json.dumps(listed))
        return
    for entry in listed:
        if "error" in entry:
            click.echo(f"{entry['format']:<12} cannot be loaded: {entry['error']}")
            continue
        options = ", ".join(f"{key} ({kind})" for key, kind in entry["options"].items()) or "no options"
        click.echo(f"{entry['format']:<12} {' '.join(entry['suffixes']):<16} {options}")
