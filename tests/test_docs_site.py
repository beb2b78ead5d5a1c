"""The documentation site builds with ``mkdocs build --strict``, and its generated references are complete.

The site (mkdocs.yml, Material theme, mkdocstrings, mkdocs-click and the hooks in docs/_hooks/) is built once
into a temporary directory; any warning (a broken link or anchor, a reference mkdocstrings cannot resolve,
an error class without a troubleshooting section) fails the build. The generated pages are then checked
against the code they come from: every name of ``ckptd.__all__``, every subcommand, every setting and every
error class appears. A second, small build shows that strict mode really fails on a broken link.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
HOOKS = DOCS / "_hooks" / "ckptd_docs.py"
BUILD_TIMEOUT_S = 600  # only a hang trips it; a build takes about 20 s


def _mkdocs(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[dev]' (it installs the documentation tools)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S)


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ckptd_docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = _mkdocs("build", "--strict", "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(out))
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{log[-6000:]}"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_every_docs_page_is_built_and_in_the_nav(site):
    pages = sorted(p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")
                   if not any(part.startswith(("_", ".")) for part in p.relative_to(DOCS).parts))
    assert {"index", "concepts", "troubleshooting", "architecture", "reference/api", "reference/cli",
            "reference/configuration"} <= set(pages)
    home = (site / "index.html").read_text(encoding="utf-8")
    for page in pages:
        if page == "index":
            continue
        assert (site / page / "index.html").is_file(), f"docs/{page}.md was not built"
        assert f'href="{page}/"' in home, f"docs/{page}.md is not in the site's navigation"


def test_the_api_reference_documents_every_public_name(site):
    import ckptd

    html = _page(site, "reference/api")
    missing = [name for name in ckptd.__all__ if not name.startswith("__") and f'id="ckptd.{name}"' not in html]
    assert not missing, f"names of ckptd.__all__ missing from the API reference: {missing}"
    assert 'id="ckptd.CheckpointManager.save"' in html, "the manager's methods are not documented"


def test_the_cli_reference_documents_every_subcommand_and_option(site):
    import click

    from ckptd.cli.main import _SUBCOMMANDS, cli

    html = _page(site, "reference/cli")
    ctx = click.Context(cli, info_name="ckptd")
    for entry in _SUBCOMMANDS:
        name = entry[1]
        assert f'id="ckptd-{name}"' in html, f"ckptd {name} is missing from the CLI reference"
        command = cli.get_command(ctx, name)
        assert command is not None
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            for opt in getattr(param, "opts", []):
                if opt.startswith("--"):
                    assert opt in html, f"option {opt} of ckptd {name} is missing from the CLI reference"


def test_the_configuration_reference_lists_every_setting(site):
    from ckptd.config import Settings

    html = _page(site, "reference/configuration")
    for field in dataclasses.fields(Settings):
        assert f"<code>{field.name}</code>" in html and f"<code>CKPTD_{field.name.upper()}</code>" in html, field.name
    assert "<td>16777216 (<code>16 * 1024 * 1024</code>)</td>" in html, "chunk_bytes' default is not shown"


def test_the_troubleshooting_page_gives_each_error_its_exit_code(site):
    from ckptd import errors

    html = _page(site, "troubleshooting")
    classes = _hooks().error_classes()
    assert errors.IntegrityError in classes and errors.OtherPromotionError in classes and len(classes) >= 30
    for klass in classes:
        heading = html.index(f'id="{klass.__name__.lower()}"')
        assert f"Exit code {klass.exit_code}</strong>" in html[heading:heading + 600], klass.__name__


# --- the machinery can fail ----------------------------------------------------------------------------

def test_strict_mode_fails_on_a_broken_link_and_an_error_without_a_section(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n", encoding="utf-8")
    (docs / "troubleshooting.md").write_text("# Errors\n\n### `IntegrityError`\n\nRun ckptd verify.\n",
                                             encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav:\n  - index.md\n"
                      f"hooks:\n  - {HOOKS}\n", encoding="utf-8")
    result = _mkdocs("build", "--strict", "--config-file", str(config), "--site-dir", str(tmp_path / "site"),
                     cwd=tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "'missing.md'" in log, log[-3000:]
    assert "no '### `CommitError`' section" in log, log[-3000:]
    assert "no '### `IntegrityError`' section" not in log


def test_pages_missing_from_the_nav_are_appended(tmp_path):
    (tmp_path / "listed.md").write_text("# a\n", encoding="utf-8")
    (tmp_path / "new-page.md").write_text("# b\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.md").write_text("# c\n", encoding="utf-8")
    (tmp_path / "_private").mkdir()
    (tmp_path / "_private" / "skip.md").write_text("# d\n", encoding="utf-8")
    nav = [{"Home": "listed.md"}, {"More": ["sub/deep.md"]}]
    _hooks().on_config({"docs_dir": str(tmp_path), "nav": nav})
    assert nav == [{"Home": "listed.md"}, {"More": ["sub/deep.md", "new-page.md"]}]


def test_the_settings_parser_reads_comments_and_shared_comments():
    docs = {doc.name: doc for doc in _hooks().setting_docs()}
    from ckptd.config import Settings

    assert list(docs) == [field.name for field in dataclasses.fields(Settings)]
    assert docs["chunk_bytes"].comment == "Largest piece a tensor is cut into before hashing and encoding."
    assert docs["chunk_bytes"].source == "16 * 1024 * 1024" and docs["chunk_bytes"].default == 16 * 1024 * 1024
    # one comment above two fields describes both
    assert docs["s3_read_timeout_s"].comment == docs["s3_connect_timeout_s"].comment != ""
    assert all(doc.comment for doc in docs.values()), [name for name, doc in docs.items() if not doc.comment]
