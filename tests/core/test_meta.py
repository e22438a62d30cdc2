"""Meta-tests: every hook is documented and tested; every OMNICORE_* setting is declared and documented once."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import omnicore
import pytest
from omnicore import hookspecs
from omnicore.config import OPTIONS

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
FIXED_HOOKS = {  # these names are the public contract
    "omnicore_register_models", "omnicore_register_platforms", "omnicore_register_attention_backends",
    "omnicore_register_cache_methods", "omnicore_preprocess", "omnicore_denoise", "omnicore_cache",
    "omnicore_attention_backend", "omnicore_postprocess",
    "omnicore_register_ops",  # the kernel seam
}
HOOKS = sorted(n for n, f in vars(hookspecs).items()
               if inspect.isfunction(f) and hasattr(f, f"{hookspecs.PROJECT}_spec"))
ENV_NAME = re.compile(r"\bOMNICORE_[A-Z0-9_]*[A-Z0-9]\b")


def test_hookspecs_are_exactly_the_fixed_names():
    assert set(HOOKS) == FIXED_HOOKS
    assert omnicore.hookimpl is hookspecs.hookimpl


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented(hook):
    func = getattr(hookspecs, hook)
    doc = inspect.getdoc(func) or ""
    summary = doc.splitlines()[0] if doc else ""
    assert summary.strip(), f"{hook}: no one-line summary"
    for param in inspect.signature(func).parameters:
        assert re.search(rf"^:param {param}:", doc, re.M), f"{hook}: no ':param {param}:' line"
    assert re.search(r"^Use in plugins:", doc, re.M), f"{hook}: no 'Use in plugins' paragraph"
    assert re.search(r"first non-``None`` result|Return value is ignored", doc), (
        f"{hook}: the docstring must say how results combine")
    assert re.search(r"[Ww]rapper", doc), f"{hook}: the docstring must say whether wrappers are allowed"
    assert inspect.signature(func).return_annotation is not inspect.Signature.empty, f"{hook}: no return annotation"


def _tests_naming(hook: str) -> list[str]:
    """Node ids of the tests that name ``hook``: in their own body, or through a module-level class/function of
    their file that names it (a test plugin defined next to the tests), one level deep."""
    import ast

    found: list[str] = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.name == "test_meta.py":
            continue
        source = path.read_text()
        if not re.search(rf"\b{hook}\b", source):
            continue
        tree = ast.parse(source)
        naming = {node.name for node in tree.body
                  if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("test_")
                  and re.search(rf"\b{hook}\b", ast.get_source_segment(source, node) or "")}
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        for node in tests:
            body = ast.get_source_segment(source, node) or ""
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
            if re.search(rf"\b{hook}\b", body) or used & naming:
                found.append(f"{path.relative_to(REPO)}::{node.name}")
    return found


@pytest.mark.slow
def test_every_hook_is_really_called_by_a_test(tmp_path):
    """Each hook is invoked by the plugin host, during a test that names it, with an implementation from a plugin
    other than the core's own — a mention of the name is not enough. The candidate tests run in a subprocess with
    a recorder (tests/_hook_calls.py); up to four per hook, core tests first, keep it quick."""
    candidates = {hook: sorted(_tests_naming(hook), key=lambda n: (not n.startswith("tests/core/"), n))[:4]
                  for hook in HOOKS}
    missing = [hook for hook, ids in candidates.items() if not ids]
    assert not missing, f"no test names these hooks: {missing}"
    out = tmp_path / "calls.json"
    env = {**os.environ, "OMNICORE_HOOK_CALLS": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    node_ids = sorted({n for ids in candidates.values() for n in ids})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_hook_calls", "-p", "no:cacheprovider",
                           "-x", *node_ids], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    import json

    calls = json.loads(out.read_text())
    called = {hook: [n for n in ids if any(k == n or k.startswith(n + "[") for k, v in calls.items()
                                           if hook in v)] for hook, ids in candidates.items()}
    never = {hook: candidates[hook] for hook, hits in called.items() if not hits}
    assert not never, f"these hooks are named by tests that never get them called: {never}"


def test_public_surface_is_exactly_all_and_every_name_resolves():
    from omnicore import testing

    assert set(omnicore.__all__) == {"PLUGIN_API_VERSION", "__version__", "hookimpl", "Engine", "AsyncEngine",
                                     "GenerationRequest", "SamplingParams", "MediaInput", "Output", "LoRA",
                                     "ModelPool", "ModelEntry"}
    for module in (omnicore, testing):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        omnicore.Nope  # noqa: B018


KIT_FOR_KIND = {"model": "ModelPluginConformance", "platform": "PlatformConformance",
                "attention_backend": "AttentionBackendConformance", "cache_method": "CacheMethodConformance",
                "op": "PlatformOpConformance"}


def test_every_registry_record_type_is_exercised_by_the_conformance_kit():
    from omnicore import testing
    from omnicore.specs import SPEC_KINDS

    assert set(KIT_FOR_KIND) == set(SPEC_KINDS)
    kit_tests = (TESTS / "core" / "test_testing_kit.py").read_text()
    for kind, kit in KIT_FOR_KIND.items():
        assert kit in testing.__all__ and getattr(testing, kit) is not None, f"no conformance kit for {kind}"
        assert re.search(rf"^class Test\w+\({kit}\):", kit_tests, re.M), (
            f"tests/core/test_testing_kit.py runs no {kit} subclass against a real {kind} record")


# ------------------------------------------------------------------------------------------- settings

README_ROW = re.compile(r"^\| `(OMNICORE_[A-Z0-9_]+)` \| (`--[a-z0-9-]+`|\(env only\)) \| (.*?) \| (.*) \|$")


def _readme_rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        m = README_ROW.match(line.strip())
        if m:
            assert m.group(1) not in rows, f"README lists {m.group(1)} twice"
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_every_option_is_in_the_readme_table():
    rows = _readme_rows()
    for opt in OPTIONS:
        assert opt.env in rows, f"{opt.env} is missing from README.md's configuration table"
        flag, default, meaning = rows[opt.env]
        assert flag == (f"`{opt.cli_flag}`" if opt.cli_flag else "(env only)"), f"{opt.env}: README flag {flag}"
        assert default == f"`{opt.default!r}`", f"{opt.env}: README default {default}, OPTIONS {opt.default!r}"
        assert meaning == opt.help, f"{opt.env}: README meaning differs from OPTIONS help"
    assert set(rows) == {o.env for o in OPTIONS}, "README documents variables that OPTIONS does not declare"


def test_no_hidden_env_switches_in_core_source():
    declared = {o.env for o in OPTIONS}
    hidden = {}
    for path in sorted((REPO / "core").rglob("*.py")):
        for name in ENV_NAME.findall(path.read_text()):
            if name not in declared:
                hidden.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not hidden, f"OMNICORE_* names used in core/ but not declared in config.OPTIONS: {hidden}"


def test_option_names_are_unique():
    assert len({o.name for o in OPTIONS}) == len({o.env for o in OPTIONS}) == len(OPTIONS)


def test_every_documented_flag_exists_on_the_cli():
    """A flag named in OPTIONS (and so in the README) must be accepted by `omnicore generate` or `omnicore serve`."""
    from omnicore.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    accepted = {s for name in ("generate", "serve") for a in subparsers[name]._actions for s in a.option_strings}
    accepted |= {s for a in parser._actions for s in a.option_strings}
    missing = [o.cli_flag for o in OPTIONS if o.cli_flag and o.cli_flag not in accepted]
    assert not missing, f"documented flags the CLI does not accept: {missing}"


# ------------------------------------------------------------------------------------------- layout

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PLUGIN_DIRS = sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))
CORE_DEPS = {"pluggy", "attrs", "importlib-metadata", "torch", "safetensors", "huggingface-hub", "numpy", "pillow", "av"}


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _req_names(reqs: list[str]) -> dict[str, str]:
    from packaging.requirements import Requirement

    return {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in reqs}


def test_root_is_a_workspace_with_the_pytest_markers():
    root = _toml(REPO / "pyproject.toml")
    assert "build-system" not in root, "the root pyproject is tooling only, never built"
    markers = {m.split(":")[0] for m in root["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"slow", "gpu", "npu", "benchmark"} <= markers
    for path in ("Makefile", ".ci/run", "core/pyproject.toml", "tests/core", "benchmarks"):
        assert (REPO / path).exists(), path
    assert (REPO / ".ci/run").stat().st_mode & 0o111, ".ci/run must be executable"


def test_core_distribution_metadata():
    project = _toml(REPO / "core/pyproject.toml")["project"]
    assert project["name"] == "omnicore" and project["version"] == omnicore.__version__
    assert project["scripts"] == {"omnicore": "omnicore.cli.main:main"}
    assert project["entry-points"]["pytest11"] == {"omnicore": "omnicore.testing.pytest_plugin"}
    deps = _req_names(project["dependencies"])
    assert CORE_DEPS <= set(deps)
    assert set(_req_names(project["optional-dependencies"]["serve"])) >= {
        "fastapi", "uvicorn", "prometheus-client", "python-multipart"}
    assert set(_req_names(project["optional-dependencies"]["test"])) >= {"pytest", "httpx", "openai", "schemathesis"}
    every = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    assert not [r for r in every if "==" in r], "distributions declare ranges, never pins"
    assert (REPO / "core/omnicore/py.typed").exists() and (REPO / "core" / project["readme"]).exists()


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugin_distribution_follows_the_naming_rule(plugin_dir):
    from packaging.requirements import Requirement

    name = plugin_dir.name
    project = _toml(plugin_dir / "pyproject.toml")["project"]
    assert project["name"] == "omni-plugin-" + name.replace("_", "-")
    package = plugin_dir / f"omni_{name}"
    assert (package / "__init__.py").exists() and (package / "py.typed").exists()
    assert project["entry-points"]["omnicore"] == {name: f"omni_{name}.plugin"}
    assert (plugin_dir / project["readme"]).exists()
    reqs = {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}
    core = reqs["omnicore"].specifier
    assert omnicore.__version__ in core and any(s.operator == "<" for s in core), (
        f"{project['name']} must require omnicore>=X,<Y admitting {omnicore.__version__}, got {core}")
    assert not [r for r in project["dependencies"] if "==" in r], "plugins never pin (torch least of all)"


def test_readme_quickstart_is_exactly_make_serve_and_make_test():
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make serve", "make test"]


# ------------------------------------------------------------------------------------------- Makefile and CI


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.fixture
def ready_venv(tmp_path) -> Path:
    """A venv stand-in whose install stamp is up to date: `make test` goes straight to pytest."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    for tool in ("ruff", "mypy"):  # `make lint` has its own CI step; here it stands in as passing
        script = venv / "bin" / tool
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
    stamp = venv / ".omnicore-installed"
    stamp.touch()
    later = time.time() + 3600
    os.utime(stamp, (later, later))
    return venv


pytestmark_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytestmark_make
@pytest.mark.parametrize("target", ["test", "serve"])
def test_make_creates_the_venv_then_installs_torch_then_every_distribution(target, tmp_path):
    venv = tmp_path / "fresh"
    plan = _make("-n", target, f"VENV={venv}").stdout.splitlines()
    steps = [next(i for i, line in enumerate(plan) if needle in line)
             for needle in ("-m venv", '"torch==2.13.0"', '-e "core[serve,test')]
    assert steps == sorted(steps), plan
    install = plan[steps[2]]
    editable = re.findall(r"-e (\S+)", install)
    assert editable[0] == '"core[serve,test,quantization,postgres]"', install  # test extra, torchao, psycopg
    assert sorted(editable[1:]) == [f"plugins/{p.name}" for p in PLUGIN_DIRS], install
    assert '"torch>=2.6"' in _make("-n", target, f"VENV={venv}", "TORCH_SPEC=torch>=2.6").stdout


@pytestmark_make
def test_make_test_fails_clearly_when_pytest_collects_nothing(ready_venv):
    args = ["test", f"VENV={ready_venv}", "PYTEST_ARGS=-q -p no:cacheprovider tests/core/test_config.py -k zzz_none"]
    proc = _make(*args)
    assert proc.returncode != 0
    assert "pytest collected no tests (exit 5)" in proc.stderr
    proc = _make(*args, "ALLOW_NO_TESTS=1")
    assert proc.returncode == 0 and "no tests selected (pytest exit 5); allowed" in proc.stderr


@pytestmark_make
def test_ci_run_goes_through_make_test(ready_venv):
    env = {"VENV": str(ready_venv), "CI_PYTEST_ARGS": "tests/core/test_config.py -k flag_beats_env"}
    proc = subprocess.run(["bash", str(REPO / ".ci/run")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"\b1 passed\b", proc.stdout)
    env["CI_PYTEST_ARGS"] = "tests/core/test_config.py -k zzz_none"  # a narrowed run may select nothing
    proc = subprocess.run(["bash", str(REPO / ".ci/run")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0 and "make test-all: no tests selected" in proc.stderr


@pytestmark_make
def test_make_test_is_the_fast_default_and_ci_runs_everything_then_the_isolation_check(tmp_path):
    venv = tmp_path / "fresh"
    fast = [line for line in _make("-n", "test", f"VENV={venv}").stdout.splitlines() if "-m pytest" in line]
    full = [line for line in _make("-n", "test-all", f"VENV={venv}").stdout.splitlines() if "-m pytest" in line]
    assert len(fast) == 1 and '-m "not slow"' in fast[0], fast
    assert len(full) == 1 and "not slow" not in full[0], full
    isolation = _make("-n", "test-isolation", f"VENV={venv}").stdout
    assert ".ci/isolated.py" in isolation
    ci = (REPO / ".ci/run").read_text()
    assert "make test " in ci and "make test-slow" in ci and "make test-isolation" in ci
    slow = [line for line in _make("-n", "test-slow", f"VENV={venv}").stdout.splitlines() if "-m pytest" in line]
    assert len(slow) == 1 and "-m slow" in slow[0], slow
