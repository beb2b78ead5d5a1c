"""The built distribution holds every package: each directory under ``ckptd/`` with an ``__init__.py``
is listed in ``pyproject.toml`` (an editable install finds unlisted ones, a wheel silently drops them)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_distribution() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "ckptd").rglob("__init__.py")}
    assert found, "packages were found"
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def _can_build_here() -> bool:
    from importlib import metadata

    try:
        major = int(metadata.version("setuptools").split(".")[0])
        metadata.version("wheel")
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


def _built_wheel(tmp_path: Path) -> Path:
    """A wheel built from a copy of the sources (the checkout gets no build/ or egg-info from this)."""
    import shutil
    import subprocess
    import sys

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("ckptd", "plugins"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # the environment's setuptools when it can build this project (no download), else pip's isolated build
    isolation = ["--no-build-isolation"] if _can_build_here() else []
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--quiet",
                           "--wheel-dir", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list((tmp_path / "dist").glob("ckptd-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_built_wheel_ships_plugins_as_ckptd_plugins_and_frameworks_only_as_extras(tmp_path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(_built_wheel(tmp_path)) as wheel:
        names = set(wheel.namelist())
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata_text = wheel.read(info).decode()
        entry_points = wheel.read(info.replace("METADATA", "entry_points.txt")).decode()
    shipped = {f"ckptd/plugins/{path.relative_to(ROOT / 'plugins').as_posix()}"
               for path in (ROOT / "plugins").rglob("*.py") if "__pycache__" not in path.parts}
    assert {"ckptd/plugins/__init__.py", "ckptd/plugins/lightning/checkpoint_io.py",
            "ckptd/plugins/shard_readers/jsonl.py"} <= shipped
    assert shipped <= names, f"missing from the wheel: {sorted(shipped - names)}"
    assert not any(name.startswith("plugins/") for name in names), "no bare plugins package"
    assert "ckptd/py.typed" in names
    assert "[ckptd.integrations]" in entry_points and "lightning = ckptd.plugins.lightning:CkptdCheckpointIO" \
        in entry_points
    assert "[lightning.pytorch.callbacks_factory]" in entry_points, "each DDP rank's RNG: the Trainer callback"
    requires = [line.split(":", 1)[1].strip() for line in metadata_text.splitlines()
                if line.startswith("Requires-Dist:")]
    core = [requirement for requirement in requires if "extra ==" not in requirement]
    frameworks = ("lightning", "transformers", "accelerate", "pytorch-lightning")
    assert core and not [r for r in core if r.split(">")[0].split("=")[0].split("<")[0].strip() in frameworks], \
        f"the core install pulls a framework: {core}"
    for extra, framework in (("lightning", "lightning"), ("huggingface", "transformers"),
                             ("huggingface", "accelerate")):
        assert f"Provides-Extra: {extra}" in metadata_text
        assert any(r.startswith(framework) and f'extra == "{extra}"' in r for r in requires), (extra, framework)
    assert "Provides-Extra: integrations" in metadata_text
    dev = [r for r in requires if 'extra == "dev"' in r]
    assert dev and not [r for r in dev if any(word in r for word in (*frameworks, "huggingface", "integrations"))], \
        f"the dev extra stays without frameworks: {dev}"
