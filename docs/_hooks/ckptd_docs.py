"""MkDocs hooks of ckptd's documentation site (``hooks:`` in mkdocs.yml).

- every ``docs/*.md`` page missing from the nav is appended to its "More" section, so a page added
  later is built, linked and checked without an edit of mkdocs.yml;
- every subcommand of ``ckptd.cli.main``'s lazy click group is registered before mkdocs-click walks it;
- ``<!-- ckptd:api -->`` is replaced by a mkdocstrings block for every public name in ``ckptd.__all__``;
- ``<!-- ckptd:settings -->`` is replaced by the configuration reference, generated from
  :class:`ckptd.config.Settings` (name, ``CKPTD_*`` variable, type, default, the field's ``#:`` comment);
- in ``troubleshooting.md`` each ``### `SomeError` `` heading gets the class's exit code, parent and
  docstring, and a warning (an error under ``--strict``) names every class of :mod:`ckptd.errors` that has
  no heading there and every heading that names no class.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.ckptd_docs")

SETTINGS_MARKER = "<!-- ckptd:settings -->"
#: The nav section that pages not listed in mkdocs.yml are appended to.
MORE_SECTION = "More"
_ERROR_HEADING = re.compile(r"^### `(\w+)`\s*$", re.MULTILINE)


# --- nav -------------------------------------------------------------------------------------------

def _listed(nav: Any) -> set[str]:
    """Every page path named anywhere in a nav (a list of strings and one-key dicts)."""
    found: set[str] = set()
    if isinstance(nav, str):
        found.add(nav)
    elif isinstance(nav, list):
        for item in nav:
            found |= _listed(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            found |= _listed(value)
    return found


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    nav = config.get("nav")
    if nav is not None:
        listed = _listed(nav)
        missing = sorted(path.relative_to(docs).as_posix() for path in docs.rglob("*.md")
                         if not any(part.startswith(("_", ".")) for part in path.relative_to(docs).parts))
        missing = [page for page in missing if page not in listed]
        if missing:
            section = next((item for item in nav if isinstance(item, dict) and MORE_SECTION in item), None)
            if section is None:
                section = {MORE_SECTION: []}
                nav.append(section)
            section[MORE_SECTION].extend(missing)
    _register_subcommands()
    return config


def _register_subcommands() -> None:
    """Add every lazily imported subcommand to the group, so that mkdocs-click documents them all."""
    import click

    from ckptd.cli.main import cli

    ctx = click.Context(cli, info_name="ckptd")
    for name in cli.list_commands(ctx):
        if cli.get_command(ctx, name) is None:
            log.warning("ckptd docs: the subcommand %r of ckptd.cli.main could not be loaded", name)


# --- pages -----------------------------------------------------------------------------------------

def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    if page.file.src_uri == "troubleshooting.md":
        markdown = annotate_errors(markdown)
    return markdown


@dataclasses.dataclass(frozen=True)
class SettingDoc:
    """One field of :class:`ckptd.config.Settings` as the configuration reference shows it."""

    name: str
    kind: str
    default: Any
    source: str
    comment: str

    @property
    def variable(self) -> str:
        return f"CKPTD_{self.name.upper()}"


def setting_docs() -> list[SettingDoc]:
    """The fields of Settings in source order, each with the ``#:`` comment block above it (a block
    written above several fields in a row describes each of them)."""
    from ckptd import config as config_module

    source = Path(inspect.getfile(config_module)).read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    klass = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings")
    defaults = {field.name: field.default for field in dataclasses.fields(config_module.Settings)}
    docs: list[SettingDoc] = []
    comment = ""
    previous_end = klass.body[0].end_lineno or 0
    for node in klass.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = node.end_lineno or previous_end
            continue
        block = []
        for number in range(node.lineno - 1, previous_end, -1):  # lines above, nearest first
            text = lines[number - 1].strip()
            if not text.startswith("#:"):
                break
            block.append(text[2:].strip())
        if block:
            comment = " ".join(reversed(block))
        name = node.target.id
        docs.append(SettingDoc(name=name, kind=ast.get_source_segment(source, node.annotation) or "",
                               default=defaults[name],
                               source=ast.get_source_segment(source, node.value) if node.value else "",
                               comment=comment))
        previous_end = node.end_lineno or node.lineno
    return docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_reference() -> str:
    rows = ["| Setting | Environment variable | Type | Default | What it does |",
            "|---|---|---|---|---|"]
    for doc in setting_docs():
        default = repr(doc.default)
        if doc.source and doc.source != default:
            default = f"{default} (`{doc.source}`)"
        rows.append(f"| `{doc.name}` | `{doc.variable}` | `{doc.kind}` | {_cell(default)} | {_cell(doc.comment)} |")
    return "\n".join(rows)


def error_classes() -> list[type]:
    """Every error class defined in :mod:`ckptd.errors`, in source order."""
    from ckptd import errors

    classes = [value for value in vars(errors).values() if inspect.isclass(value)
               and issubclass(value, errors.CkptdError) and value.__module__ == errors.__name__]
    return sorted(classes, key=lambda klass: inspect.getsourcelines(klass)[1])


def annotate_errors(markdown: str) -> str:
    """Each ``### `Name` `` heading followed by the class's exit code, parent and docstring; a warning
    for every class without a heading and every heading without a class."""
    classes = {klass.__name__: klass for klass in error_classes()}
    named = _ERROR_HEADING.findall(markdown)
    for name in sorted(set(classes) - set(named)):
        log.warning("ckptd docs: troubleshooting.md has no '### `%s`' section (an error class of ckptd.errors)", name)
    for name in sorted(set(named) - set(classes)):
        log.warning("ckptd docs: troubleshooting.md has a section for `%s`, which is no class of ckptd.errors", name)

    def annotate(match: re.Match[str]) -> str:
        klass = classes.get(match.group(1))
        if klass is None:
            return match.group(0)
        parent = klass.__mro__[1].__name__
        doc = " ".join(inspect.cleandoc(klass.__doc__ or "").split())
        doc = re.sub(r":(?:class|attr|mod|func|meth):`~?([^`]+)`", r"`\1`", doc).replace("``", "`")
        facts = f"**Exit code {klass.exit_code}**"
        if parent != "Exception":
            facts += f" · a kind of `{parent}`"
        return f"{match.group(0)}\n\n{facts}. *{doc}*\n"

    return _ERROR_HEADING.sub(annotate, markdown)


API_MARKER = "<!-- ckptd:api -->"
#: Sections of the API reference: a public name goes to the first whose module prefix it is defined under.
_API_SECTIONS = (("Errors", "ckptd.errors"), ("Data loading", "ckptd.data"), ("Checkpoints", "ckptd"))


def api_reference() -> str:
    """A ``::: ckptd.<name>`` block (mkdocstrings) for every public name in ``ckptd.__all__``, by section."""
    import ckptd

    sections: dict[str, list[str]] = {title: [] for title, _ in _API_SECTIONS}
    for name in ckptd.__all__:
        if name.startswith("__"):
            continue
        value = getattr(ckptd, name)
        module = getattr(value, "__module__", "ckptd")
        title = next(title for title, prefix in _API_SECTIONS if module == prefix or module.startswith(prefix + "."))
        sections[title].append(name)
    parts = [f"Version {ckptd.__version__}."]
    for title, _ in reversed(_API_SECTIONS):
        names = sections[title]
        if not names:
            continue
        parts.append(f"## {title}")
        parts.extend(f"::: ckptd.{name}\n    options:\n      heading_level: 3\n" for name in names)
    return "\n\n".join(parts)
