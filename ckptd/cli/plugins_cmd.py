"""``ckptd plugins``: every installed plugin of each entry-point group, what it needs, whether it imports.

Groups: ``ckptd.storage`` (tiers by URL scheme), ``ckptd.shard_readers`` (data-shard formats) and
``ckptd.integrations`` (Lightning, Hugging Face). Each entry point is imported to tell whether it works
now (``--no-import`` only lists them); one that does not import shows the reason and the install hint.
Exit status: 0 (a plugin that does not import is reported, not an error).
"""

from __future__ import annotations

import click

from ckptd.cli.options import json_option, print_json


@click.command("plugins")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@click.option("--group", "groups", multiple=True, metavar="GROUP",
              help="Only this entry-point group (repeatable): ckptd.storage, ckptd.shard_readers, ckptd.integrations; "
                   "the part after 'ckptd.' is enough.")
@click.option("--no-import", "no_import", is_flag=True, help="List the entry points without importing them.")
@json_option
def plugins(names: tuple[str, ...], groups: tuple[str, ...], no_import: bool, as_json: bool) -> None:
    """List installed plugins per entry-point group, the extra each needs and whether it imports now.

    NAME limits the listing to the plugins of that name (``ckptd plugins lightning``)."""
    from ckptd.plugin_loading import PLUGIN_GROUPS, list_plugins

    chosen = []
    for group in groups:
        name = group if group.startswith("ckptd.") else f"ckptd.{group}"
        if name not in PLUGIN_GROUPS:
            raise click.BadParameter(f"{group!r} is not one of {', '.join(PLUGIN_GROUPS)}", param_hint="--group")
        chosen.append(name)
    found = list_plugins(tuple(chosen) or PLUGIN_GROUPS, try_import=not no_import, names=names or None)
    if as_json:
        print_json([info.to_json() for info in found])
        return
    for group in tuple(chosen) or PLUGIN_GROUPS:
        click.echo(group)
        entries = [info for info in found if info.group == group]
        if not entries:
            click.echo("  (none installed)" if not names else "  (none of that name)")
        width = max((len(info.name) for info in entries), default=0)
        for info in entries:
            needs = (f"needs {info.distribution}[{','.join(info.extras)}]: {', '.join(info.requirements) or '-'}"
                     if info.extras else "needs nothing extra")
            if info.missing:
                needs += f" (missing: {', '.join(info.missing)})"
            if info.importable is None:
                state = "not imported"
            elif info.importable:
                state = "imports: yes"
            else:
                state = f"imports: no ({info.error}); {info.install_hint}"
            click.echo(f"  {info.name:<{width}}  {info.target}  {needs}  {state}")
