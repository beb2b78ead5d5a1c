"""The layers of ckptd point one way; this test reads every import and keeps it so.

Every module under ``ckptd/`` (and ``plugins/``, imported as ``ckptd.plugins``) is parsed with ``ast``;
each ``import``/``from ... import`` is an edge, wherever it sits: at module level, inside a function or
class, or under ``if TYPE_CHECKING:`` (a type-only import is still a dependency). The rules:

- layers, lowest first: ``format`` (0) < ``tiers`` (1) < ``stepio``, ``state`` (2) < ``manager``,
  ``dcp``, ``promotion``, ``data`` (3) < ``daemon``, ``elastic`` and the ``ckptd`` package itself, which
  re-exports the public API (4) < ``cli``, ``demo``, ``bench``, ``embedded_s3`` (5). A module imports its
  own layer or a lower one, never a higher one;
- leaves (``errors``, ``config``, ``_types``, ``_version``, ``policy``, ``background``, ``plugin_loading``)
  may be imported
  from anywhere and import only leaves; ``errors`` and ``_version`` import nothing of ckptd, ``policy``
  only ``errors``;
- ``format`` imports nothing of ckptd but ``errors``, ``config``, ``_types``, ``_version`` and itself;
- ``testing`` may import anything (and nothing but ``testing`` imports it);
- plugins use the public API only: ``ckptd``, ``ckptd.errors``, ``ckptd.policy``, ``ckptd.config`` (settings),
  ``ckptd.background`` (the threads and pools every thread of ckptd is started through), ``ckptd.data``,
  ``ckptd.data.reader_api`` (the shard-reader interface), ``ckptd.dcp``, ``ckptd.export`` and each other;
- packages of one layer never import each other in a cycle (``manager -> dcp`` is fine only while
  ``dcp`` never imports ``manager``, directly or through another package of that layer);
- every module belongs to a layer or is a leaf (a new top-level package must be placed in the table).

The layer table itself is read from ``docs/architecture.md`` (the code map), so the page and this test
cannot disagree.

Each violation is reported as ``module A imports B (layer x -> layer y)`` with its file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"ckptd": REPO / "ckptd", "ckptd.plugins": REPO / "plugins"}

ARCHITECTURE = REPO / "docs" / "architecture.md"


def layers_from_architecture(text: str) -> dict[str, int]:
    """The layer table of docs/architecture.md (rows ``| `package` | layer | job |`` between the
    ``layers:begin`` and ``layers:end`` comments): the rule this test enforces is the one the page states."""
    begin, end = text.find("<!-- layers:begin"), text.find("<!-- layers:end -->")
    assert 0 <= begin < end, f"{ARCHITECTURE.name} has no layer table between layers:begin and layers:end"
    layers: dict[str, int] = {}
    for line in text[begin:end].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[1].isdigit():
            layers[cells[0].strip("`")] = int(cells[1])
    return layers


LAYERS: dict[str, int] = layers_from_architecture(ARCHITECTURE.read_text(encoding="utf-8"))
#: What each leaf may import (leaves only).
LEAVES: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "_version": frozenset(),
    "_types": frozenset({"errors"}),
    "config": frozenset({"errors", "_types"}),
    "policy": frozenset({"errors"}),
    "background": frozenset({"errors", "config", "_types"}),
    "plugin_loading": frozenset({"errors"}),
}
FORMAT_MAY_IMPORT = frozenset({"format", "errors", "config", "_types", "_version"})
ANYTHING_GOES = frozenset({"testing"})
PLUGIN_API = frozenset({"ckptd", "ckptd.errors", "ckptd.policy", "ckptd.config", "ckptd.background", "ckptd.data",
                        "ckptd.data.reader_api", "ckptd.dcp", "ckptd.export"})


@dataclass(frozen=True)
class Edge:
    """``source`` (a module) imports ``target`` (a module or package) at ``file:line``."""

    source: str
    target: str
    file: str
    line: int


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: Iterable[str], *, repo: Path = REPO) -> Iterator[Edge]:
    """Every ckptd module or package that ``module`` (the file ``path``) imports, anywhere in its source."""
    known = set(known)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(repo).as_posix()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            # ``from ckptd.format import codecs`` imports the module ckptd.format.codecs
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            if target == "plugins" or target.startswith("plugins."):
                yield Edge(module, target, rel, node.lineno)
            elif target == "ckptd" or target.startswith("ckptd."):
                yield Edge(module, target, rel, node.lineno)


def unit_of(module: str) -> str:
    """The layer unit of a module: its sub-package or top-level module (``ckptd`` for the package)."""
    parts = module.split(".")
    if parts[0] == "plugins":
        return "plugins"
    if len(parts) == 1:
        return "ckptd"
    if parts[1] == "plugins":
        return "plugins"
    return parts[1]


def _layer(unit: str) -> str:
    if unit in LAYERS:
        return f"layer {LAYERS[unit]} {unit}"
    if unit in LEAVES:
        return f"leaf {unit}"
    return unit


def violations(edges: Iterable[Edge]) -> list[str]:
    """Every edge that breaks a rule of the module docstring, one line each."""
    edges = list(edges)
    problems: list[str] = []

    def report(edge: Edge, why: str = "") -> None:
        source, target = unit_of(edge.source), unit_of(edge.target)
        problems.append(f"module {edge.source} imports {edge.target} ({_layer(source)} -> {_layer(target)})"
                        f"{why} at {edge.file}:{edge.line}")

    for edge in edges:
        source, target = unit_of(edge.source), unit_of(edge.target)
        if edge.target == "plugins" or edge.target.startswith("plugins."):
            report(edge, ": import plugins as ckptd.plugins")
        elif source in ANYTHING_GOES or source == target:
            continue
        elif target in ANYTHING_GOES:
            report(edge, ": only tests and ckptd.testing use ckptd.testing")
        elif source == "plugins":
            if edge.target not in PLUGIN_API:
                report(edge, f": plugins use only the public API ({', '.join(sorted(PLUGIN_API))})")
        elif target == "plugins":
            report(edge, ": plugins are found through entry points, never imported")
        elif source in LEAVES:
            if target not in LEAVES[source]:
                report(edge, f": leaf {source} may import only {sorted(LEAVES[source]) or 'nothing of ckptd'}")
        elif source == "format" and target not in FORMAT_MAY_IMPORT:
            report(edge, ": format is pure bytes and records")
        elif target in LEAVES:
            continue
        elif source not in LAYERS:
            report(edge, f": {source} is in no layer (add it to the layer table of docs/architecture.md)")
        elif target not in LAYERS:
            report(edge, f": {target} is in no layer (add it to the layer table of docs/architecture.md)")
        elif LAYERS[target] > LAYERS[source]:
            report(edge, ": imports point down only")
    problems.extend(_cycles(edges))
    return problems


def _cycles(edges: list[Edge]) -> list[str]:
    """Cycles between different packages of one layer, each reported once with one edge per step."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        source, target = unit_of(edge.source), unit_of(edge.target)
        if source != target and source in LAYERS and LAYERS.get(target) == LAYERS[source]:
            graph.setdefault(source, {}).setdefault(target, edge)
    found: list[str] = []
    seen: set[frozenset[str]] = set()
    for start in sorted(graph):
        for path in _paths_back(graph, start):
            key = frozenset(path)
            if key in seen:
                continue
            seen.add(key)
            steps = [graph[a][b] for a, b in zip(path, path[1:] + path[:1])]
            found.append(f"packages {' -> '.join(path + path[:1])} import each other in a cycle (layer "
                         f"{LAYERS[start]}): " + "; ".join(f"module {e.source} imports {e.target} at {e.file}:{e.line}"
                                                          for e in steps))
    return found


def _paths_back(graph: dict[str, dict[str, Edge]], start: str) -> Iterator[list[str]]:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                yield path
            elif nxt not in path and nxt > start:
                stack.append((nxt, path + [nxt]))


def all_edges() -> list[Edge]:
    modules = _modules()
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


# --- the checks --------------------------------------------------------------------------------------

def test_every_module_is_parsed_and_placed():
    modules = _modules()
    assert "ckptd.format.records" in modules and "ckptd.plugins.shard_readers.jsonl" in modules
    unplaced = sorted(m for m in modules if unit_of(m) not in LAYERS and unit_of(m) not in LEAVES
                      and unit_of(m) not in ANYTHING_GOES and unit_of(m) != "plugins")
    assert not unplaced, f"modules in no layer (add their package to the table in docs/architecture.md): {unplaced}"
    edges = all_edges()
    assert len(edges) > 200, "the parser found suspiciously few imports"
    assert "ckptd.errors" in {edge.target for edge in edges if edge.source == "ckptd.format.codecs"}
    assert "ckptd.data.reader_api" in {edge.target for edge in edges if edge.source.startswith("ckptd.plugins.")}


def test_the_layer_table_is_read_from_architecture_md():
    assert LAYERS["format"] == 0 and LAYERS["tiers"] == 1 and LAYERS["cli"] == 5 and LAYERS["ckptd"] == 4
    assert len(LAYERS) >= 17, LAYERS
    assert layers_from_architecture("<!-- layers:begin -->\n| Package | Layer | Job |\n|---|---|---|\n"
                                    "| `a` | 0 | x |\n| `b` | 2 | y |\n<!-- layers:end -->") == {"a": 0, "b": 2}


def test_layers_point_one_way():
    problems = violations(all_edges())
    assert not problems, "import graph violations:\n" + "\n".join(problems)


# --- the checker itself can fail ---------------------------------------------------------------------

def _edge(source: str, target: str) -> Edge:
    return Edge(source, target, source.replace(".", "/") + ".py", 7)


@pytest.mark.parametrize(("source", "target", "expected"), [
    ("ckptd.tiers.local", "ckptd.manager.saving",
     "module ckptd.tiers.local imports ckptd.manager.saving (layer 1 tiers -> layer 3 manager)"),
    ("ckptd.format.records", "ckptd.tiers.base",
     "module ckptd.format.records imports ckptd.tiers.base (layer 0 format -> layer 1 tiers)"),
    ("ckptd.format.layout", "ckptd", "module ckptd.format.layout imports ckptd (layer 0 format -> layer 4 ckptd)"),
    ("ckptd.format.values", "ckptd.policy",
     "module ckptd.format.values imports ckptd.policy (layer 0 format -> leaf policy)"),
    ("ckptd.policy", "ckptd.config", "module ckptd.policy imports ckptd.config (leaf policy -> leaf config)"),
    ("ckptd.errors", "ckptd.config", "module ckptd.errors imports ckptd.config (leaf errors -> leaf config)"),
    ("ckptd.manager.manager", "ckptd.cli.main",
     "module ckptd.manager.manager imports ckptd.cli.main (layer 3 manager -> layer 5 cli)"),
    ("ckptd.stepio.rank_writer", "ckptd.testing.tamper",
     "module ckptd.stepio.rank_writer imports ckptd.testing.tamper (layer 2 stepio -> testing)"),
    ("ckptd.plugins.shard_readers.jsonl", "ckptd.data.cache",
     "module ckptd.plugins.shard_readers.jsonl imports ckptd.data.cache (plugins -> layer 3 data)"),
    ("ckptd.data.registry", "plugins.shard_readers.jsonl",
     "module ckptd.data.registry imports plugins.shard_readers.jsonl (layer 3 data -> plugins)"),
    ("ckptd.newthing.x", "ckptd.errors", None),
    ("ckptd.newthing.x", "ckptd.tiers", "module ckptd.newthing.x imports ckptd.tiers (newthing -> layer 1 tiers)"),
])
def test_a_bad_edge_is_reported(source, target, expected):
    problems = violations([_edge(source, target)])
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(expected), problems
        assert f"at {source.replace('.', '/')}.py:7" in problems[0]


@pytest.mark.parametrize(("source", "target"), [
    ("ckptd.cli.main", "ckptd.manager.manager"), ("ckptd.manager.saving", "ckptd.format.records"),
    ("ckptd.format.codecs", "ckptd.config"), ("ckptd.tiers.local", "ckptd.policy"),
    ("ckptd.testing.tier_conformance", "ckptd.cli.main"), ("ckptd.plugins.shard_readers.jsonl", "ckptd.data.reader_api"),
    ("ckptd.demo.runner", "ckptd"), ("ckptd.manager.saving", "ckptd.manager.commit"),
    ("ckptd.dcp.writer", "ckptd.promotion.uploader"),
])
def test_a_good_edge_is_not_reported(source, target):
    assert violations([_edge(source, target)]) == []


def test_a_cycle_between_packages_of_one_layer_is_reported():
    edges = [_edge("ckptd.manager.manager", "ckptd.dcp.writer"), _edge("ckptd.dcp.reader", "ckptd.promotion.pull"),
             _edge("ckptd.promotion.remote_sync", "ckptd.manager.restoring"),
             _edge("ckptd.data.dataset", "ckptd.manager.manager")]
    problems = violations(edges)
    assert len(problems) == 1, problems
    assert problems[0].startswith("packages dcp -> promotion -> manager -> dcp import each other in a cycle (layer 3)")
    for source, target in [("ckptd.manager.manager", "ckptd.dcp.writer"), ("ckptd.dcp.reader", "ckptd.promotion.pull"),
                           ("ckptd.promotion.remote_sync", "ckptd.manager.restoring")]:
        assert f"module {source} imports {target}" in problems[0]
    assert violations(edges[:2] + edges[3:]) == [], "without the closing edge there is no cycle"


def test_the_parser_sees_imports_in_functions_relative_imports_and_type_checking(tmp_path):
    source = tmp_path / "ckptd" / "tiers" / "sample.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from . import base\n"
        "from ..format import records\n"
        "if TYPE_CHECKING:\n"
        "    from ckptd.manager.manager import CheckpointManager\n"
        "def later():\n"
        "    import ckptd.cli.main\n"
        "    from ckptd import policy\n"
        "    return ckptd.cli.main, policy\n")
    known = {"ckptd", "ckptd.tiers", "ckptd.tiers.base", "ckptd.format", "ckptd.format.records", "ckptd.policy",
             "ckptd.manager", "ckptd.manager.manager", "ckptd.cli", "ckptd.cli.main"}
    edges = list(imports_of("ckptd.tiers.sample", source, known, repo=tmp_path))
    assert {edge.file for edge in edges} == {"ckptd/tiers/sample.py"}
    assert [(edge.target, edge.line) for edge in edges] == [
        ("ckptd.tiers.base", 4), ("ckptd.format.records", 5), ("ckptd.manager.manager", 7),
        ("ckptd.cli.main", 9), ("ckptd.policy", 10)]
    problems = violations(edges)
    assert [problem.split(" (")[0] for problem in problems] == [
        "module ckptd.tiers.sample imports ckptd.manager.manager", "module ckptd.tiers.sample imports ckptd.cli.main"]
