"""``omnicore plugins --check`` in a subprocess: a plugin whose entry module loads but whose pipeline module cannot
import shows ``loaded`` in the plain listing and is reported as failed, naming the module, with ``--check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ENTRY = """
from omnicore import hookimpl
from omnicore.plugin import ModelSpec

@hookimpl
def omnicore_register_models(register):
    register(ModelSpec(name="{model}", impl="{impl}:Pipeline"{more}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("site")
    tag = uuid.uuid4().hex[:8]
    for name, impl_source, more in (
            ("sound", "class Pipeline:\n    pass\n", ""),
            ("rotten", "import omnitest_libmissing_xyz  # a dependency the user lacks\n", ""),
            ("blind", "class Pipeline:\n    pass\n", ', detect="{impl}:looks_like_mine"'),  # a detector it lacks
    ):
        module = f"omnitest_{name}_{tag}"
        info = root / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[omnicore]\n{name} = {module}\n")
        impl = f"{module}_impl"
        (root / f"{module}.py").write_text(textwrap.dedent(ENTRY.format(model=f"{name}-model", impl=impl,
                                                                        more=more.format(impl=impl))))
        (root / f"{module}_impl.py").write_text(impl_source)
    return root, tag


def run_cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, "-m", "omnicore.cli.main", "plugins", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_without_check_the_broken_pipeline_goes_unnoticed(site):
    root, _ = site
    proc = run_cli(root, "--json")
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    assert plugins["rotten"]["status"] == plugins["sound"]["status"] == "loaded"


def test_check_reports_the_plugin_whose_pipeline_cannot_import_naming_the_module(site):
    root, tag = site
    proc = run_cli(root, "--check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert sorted(errors) == [
        f"error: plugin blind: model detect 'blind-model': cannot import omnitest_blind_{tag}_impl:looks_like_mine: "
        f"AttributeError: module 'omnitest_blind_{tag}_impl' has no attribute 'looks_like_mine'",
        f"error: plugin rotten: model 'rotten-model': cannot import omnitest_rotten_{tag}_impl:Pipeline: "
        "ModuleNotFoundError: No module named 'omnitest_libmissing_xyz'"]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "FAILED (--check)" in rows["rotten"] and "loaded, checked" in rows["sound"]


def test_check_json_lists_every_path(site):
    root, tag = site
    proc = run_cli(root, "--check", "--json")
    assert proc.returncode == 1
    checks = {c["path"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks[f"omnitest_sound_{tag}_impl:Pipeline"]["ok"] is True
    bad = checks[f"omnitest_rotten_{tag}_impl:Pipeline"]
    assert bad["ok"] is False and bad["plugin"] == "rotten" and "omnitest_libmissing_xyz" in bad["error"]
    # the repository's own plugins all import (their pipelines, platforms, backends and preset builders)
    assert checks[f"omnitest_blind_{tag}_impl:Pipeline"]["ok"] is True
    assert checks[f"omnitest_blind_{tag}_impl:looks_like_mine"]["kind"] == "model detect"
    assert all(c["ok"] for c in checks.values() if c["plugin"] not in ("rotten", "blind")), [
        c for c in checks.values() if not c["ok"]]
