"""``ckptd plugins`` and the plugin loader: every group listed, what each entry needs, whether it imports;
a missing optional dependency gives the install hint, never an ImportError traceback.

The missing dependency is real for Python: the child process sets ``sys.modules['lightning'] = None``,
so every import of lightning raises ImportError, exactly as when it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata

import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.errors import PluginError
from ckptd.plugin_loading import (INTEGRATIONS_GROUP, PLUGIN_GROUPS, install_hint, list_plugins, load_integration,
                                  load_object)

_BLOCK_LIGHTNING = "import sys; sys.modules['lightning'] = None; "


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_listing_names_every_group_and_what_each_entry_needs() -> None:
    result = CliRunner().invoke(cli, ["plugins", "--no-import", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    assert {item["group"] for item in listed} == set(PLUGIN_GROUPS)
    by_name = {(item["group"], item["name"]): item for item in listed}
    lightning = by_name[(INTEGRATIONS_GROUP, "lightning")]
    assert lightning["extras"] == ["lightning"] and lightning["install_hint"] == "pip install 'ckptd[lightning]'"
    assert any(requirement.startswith("lightning") for requirement in lightning["requirements"])
    assert lightning["importable"] is None, "--no-import imports nothing"
    s3 = by_name[("ckptd.storage", "s3")]
    assert s3["extras"] == ["s3"] and any(r.startswith("s3fs") for r in s3["requirements"])
    assert by_name[("ckptd.storage", "file")]["extras"] == []


def test_the_listing_tells_whether_each_entry_imports_now() -> None:
    result = CliRunner().invoke(cli, ["plugins", "lightning", "--group", "integrations", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    assert [item["name"] for item in listed] == ["lightning"], "NAME limits the listing"
    lightning = listed[0]
    installed = importlib.util.find_spec("lightning") is not None
    assert lightning["importable"] is installed
    assert (lightning["error"] is None) is installed


def test_a_missing_framework_shows_the_install_hint_not_a_traceback() -> None:
    done = _child(_BLOCK_LIGHTNING + "from ckptd.cli.main import main; "
                  "sys.argv = ['ckptd', 'plugins', 'lightning']; main()")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("lightning "))
    assert "imports: no" in line and "pip install 'ckptd[lightning]'" in line
    assert "Traceback" not in done.stdout + done.stderr


def test_loading_the_integration_without_its_framework_raises_plugin_error_with_the_hint() -> None:
    done = _child(_BLOCK_LIGHTNING + "from ckptd.errors import PluginError\n"
                  "from ckptd.plugin_loading import load_integration\n"
                  "for load in (lambda: load_integration('lightning'), lambda: __import__('ckptd.plugins.lightning')):\n"
                  "    try:\n        load()\n"
                  "    except PluginError as error:\n        print('PluginError', error.exit_code, error)\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert line.startswith("PluginError 11 ") and line.endswith("pip install 'ckptd[lightning]'"), line


def test_an_entry_point_that_does_not_import_becomes_plugin_error() -> None:
    entry = metadata.EntryPoint("nothing", "ckptd_no_such_module:Thing [extra]", INTEGRATIONS_GROUP)
    with pytest.raises(PluginError, match="could not be imported") as caught:
        load_object(entry, what="the test plugin")
    assert isinstance(caught.value.__cause__, ImportError)
    assert caught.value.hint == install_hint(entry) == "install the package that provides 'ckptd_no_such_module:Thing'"


def test_an_unknown_integration_names_the_known_ones() -> None:
    with pytest.raises(PluginError, match="no ckptd integration named 'tensorflow'") as caught:
        load_integration("tensorflow")
    assert "lightning" in str(caught.value)


def test_an_unknown_group_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["plugins", "--group", "bogus"])
    assert result.exit_code == 2 and "ckptd.integrations" in result.output


def test_listing_without_import_imports_no_plugin() -> None:
    done = _child("import sys; from ckptd.plugin_loading import list_plugins; infos = list_plugins(try_import=False); "
                  "print(len(infos), 'lightning' in sys.modules, 'ckptd.plugins.lightning' in sys.modules)")
    assert done.returncode == 0, done.stderr
    count, lightning, plugin = done.stdout.split()
    assert int(count) == len(list_plugins(try_import=False)) > 5 and lightning == plugin == "False"
