"""A throwaway third-party plugin distribution, really pip-installed (no network) into a temporary target.

Two distributions are built in a temp dir: a good one and one whose import raises. They are installed with
``pip install --target`` into a temporary directory that the subprocesses put on ``PYTHONPATH``, so the dev
venv is never modified (a crashed run leaves nothing behind). ``omnicore plugins --json`` (the installed
console script) lists the good one with what it registered and the broken one as FAILED. The good plugin's
own test suite, written the way a third party would with ``omnicore.testing``, passes. Our own wheels are
built from copies of the source trees, so no ``build/`` or ``*.egg-info`` lands in the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~10-20 s: two pip installs and an uninstall

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"
requires-python = ">=3.10"
dependencies = ["omnicore>=0.1"]

[project.entry-points.omnicore]
{ep} = "{pkg}.plugin"

[tool.setuptools]
packages = ["{pkg}"]
"""

GOOD_PLUGIN = """
from omnicore import hookimpl
from omnicore.plugin import AttentionBackendSpec, AttentionCapabilities, ModelSpec


def plugin_info():
    return {{"kind": "model", "api": ">=1.0,<2", "models": ["{model}"], "attention_backends": ["{backend}"]}}


@hookimpl
def omnicore_register_models(register):
    register(ModelSpec(name="{model}", impl="{pkg}.pipeline:Pipeline", aliases=("{model}Pipeline",)))


@hookimpl
def omnicore_register_attention_backends(register):
    register(AttentionBackendSpec(name="{backend}", impl="omnicore.attention.reference:sdpa_attention",
                                  capabilities=AttentionCapabilities(packed_varlen=True)))
"""

PIPELINE = """
class Pipeline:
    \"\"\"Named lazily by the spec; never imported by `omnicore plugins`.\"\"\"
"""

BROKEN_PLUGIN = """
raise RuntimeError("{pkg} cannot find its native library")
"""

AUTHOR_TESTS = """
from omnicore.testing import AttentionBackendConformance, PluginConformance


class TestMyPlugin(PluginConformance):
    plugin_module = "{pkg}.plugin"
    entry_point_name = "{ep}"
    require_plugin_info = True


class TestMyBackend(AttentionBackendConformance):
    backend = "{backend}"
    plugin_module = "{pkg}.plugin"
    dtypes = ("float32",)
"""


def _write_dist(root: Path, dist: str, version: str, ep: str, pkg: str, files: dict[str, str]) -> Path:
    project = root / dist
    (project / pkg).mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, version=version, ep=ep, pkg=pkg))
    (project / pkg / "__init__.py").write_text("")
    for name, source in files.items():
        (project / pkg / name).write_text(textwrap.dedent(source))
    return project


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    names = {
        "good_dist": f"omnitest-tp-good-{tag}", "good_ep": f"tp_good_{tag}", "good_pkg": f"omnitest_tp_good_{tag}",
        "bad_dist": f"omnitest-tp-broken-{tag}", "bad_ep": f"tp_broken_{tag}", "bad_pkg": f"omnitest_tp_broken_{tag}",
        "model": f"tpmodel-{tag}", "backend": f"tpattn-{tag}",
    }
    root = tmp_path_factory.mktemp("dists")
    good = _write_dist(root, names["good_dist"], "0.3.1", names["good_ep"], names["good_pkg"], {
        "plugin.py": GOOD_PLUGIN.format(model=names["model"], backend=names["backend"], pkg=names["good_pkg"]),
        "pipeline.py": PIPELINE,
    })
    bad = _write_dist(root, names["bad_dist"], "0.0.1", names["bad_ep"], names["bad_pkg"], {
        "plugin.py": BROKEN_PLUGIN.format(pkg=names["bad_pkg"]),
    })
    target = root / "site"
    proc = _pip("install", "--no-build-isolation", "--no-deps", "--no-index", "--target", str(target), str(good),
                str(bad))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield {**names, "site": str(target)}  # nothing to uninstall: the target dir is thrown away with tmp


def _env(site: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _plugins_json(site: str, **env: str) -> tuple[dict[str, dict], dict]:
    script = Path(sys.executable).with_name("omnicore")  # the installed console script
    proc = subprocess.run([str(script), "plugins", "--json"], env=_env(site, **env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    return {p["name"]: p for p in payload["plugins"]}, payload


def test_installed_plugin_is_listed_with_its_registrations(installed):
    plugins, payload = _plugins_json(installed["site"])
    good = plugins[installed["good_ep"]]
    assert good["status"] == "loaded", good["error"]
    assert (good["dist"], good["version"]) == (installed["good_dist"], "0.3.1")
    assert good["value"] == f"{installed['good_pkg']}.plugin"
    assert good["registered"] == {"model": [installed["model"]], "attention_backend": [installed["backend"]]}
    assert payload["registries"]["model"][installed["model"]] == installed["good_ep"]
    assert plugins["omnicore"]["status"] == "loaded"


def test_plugin_whose_import_raises_is_failed_while_others_load(installed):
    plugins, payload = _plugins_json(installed["site"])
    bad = plugins[installed["bad_ep"]]
    assert bad["status"] == "failed"
    assert bad["dist"] == installed["bad_dist"]
    assert f"RuntimeError: {installed['bad_pkg']} cannot find its native library" in bad["error"]
    assert plugins[installed["good_ep"]]["status"] == "loaded"
    assert [p for p in payload["problems"] if installed["bad_ep"] in p] == [
        f"plugin '{installed['bad_ep']}' FAILED: {bad['error']}"]


def test_deny_list_keeps_the_broken_plugin_from_being_imported(installed):
    plugins, payload = _plugins_json(installed["site"], OMNICORE_DISABLE_PLUGINS=installed["bad_ep"])
    assert plugins[installed["bad_ep"]]["status"] == "disabled"
    assert not any(installed["bad_ep"] in p for p in payload["problems"])


def test_the_authors_conformance_suite_passes(installed, tmp_path):
    """What a third party runs: their tests subclass the kit; pytest loads ``omnicore.testing`` via pytest11."""
    test_file = tmp_path / "test_my_plugin.py"
    test_file.write_text(textwrap.dedent(AUTHOR_TESTS.format(pkg=installed["good_pkg"], ep=installed["good_ep"],
                                                             backend=installed["backend"])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                          cwd=tmp_path, env=_env(installed["site"]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and " passed" in summary


# ------------------------------------------------------------------------------------------- our own wheels

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [REPO / "core", *sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))]


@pytest.mark.parametrize("project", DISTRIBUTIONS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_distribution_builds_a_complete_wheel_on_its_own(project, tmp_path):
    """every distribution builds alone (no workspace tooling), and the wheel carries what an
    installed copy needs: the package, ``py.typed``, the entry points and the ``omnicore`` requirement."""
    import shutil
    import zipfile

    copy = tmp_path / "src" / project.name  # build from a copy: setuptools writes build/ and *.egg-info
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path), str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    package = "omnicore" if project.name == "core" else f"omni_{project.name}"
    sources = {str(p.relative_to(project)) for p in (project / package).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert sources <= names, f"missing from the wheel: {sorted(sources - names)}"  # py.typed, README.md ...
    assert f"{package}/py.typed" in names
    if project.name == "core":
        assert "omnicore = omnicore.cli.main:main" in entry_points and "[pytest11]" in entry_points
    else:
        assert f"[omnicore]\n{project.name} = omni_{project.name}.plugin" in entry_points
        assert any(line.startswith("Requires-Dist: omnicore") and "<" in line for line in metadata.splitlines())
