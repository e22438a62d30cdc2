"""``omnicore plugins`` in a subprocess: allow/deny lists through env vars, failures, JSON, and no torch import.

Plugins are made visible to the subprocess without pip: a ``*.dist-info`` folder with ``entry_points.txt``
on ``PYTHONPATH`` is a real installed distribution as far as ``importlib.metadata`` is concerned.
(tests/core/test_third_party.py does the real pip install.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

HEAVY = ("torch", "diffusers", "transformers")

MODEL_PLUGIN = """
from omnicore import hookimpl
from omnicore.specs import ModelSpec

def plugin_info():
    return {{"kind": "model", "api": ">=1.0,<2"}}

@hookimpl
def omnicore_register_models(register):
    register(ModelSpec(name="{model}", impl="{module}_impl:Pipeline"))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder holding three fake distributions: two good plugins and one whose import raises."""
    root = tmp_path_factory.mktemp("site")
    tag = uuid.uuid4().hex[:8]

    def dist(dist_name: str, ep_name: str, module: str, source: str) -> None:
        info = root / f"{dist_name.replace('-', '_')}-0.{len(ep_name)}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.{len(ep_name)}\n")
        (info / "entry_points.txt").write_text(f"[omnicore]\n{ep_name} = {module}\n")
        (root / f"{module}.py").write_text(textwrap.dedent(source))

    dist(f"omnitest-alpha-{tag}", "alpha", f"omnitest_alpha_{tag}",
         MODEL_PLUGIN.format(model="alpha-model", module=f"omnitest_alpha_{tag}"))
    dist(f"omnitest-beta-{tag}", "beta", f"omnitest_beta_{tag}",
         MODEL_PLUGIN.format(model="beta-model", module=f"omnitest_beta_{tag}"))
    dist(f"omnitest-broken-{tag}", "broken", f"omnitest_broken_{tag}",
         "raise ImportError('this plugin needs libmissing')\n")
    (root / "tag").write_text(tag)
    return root


def run_cli(site: Path | None, *args: str, **env: str) -> subprocess.CompletedProcess:
    extra = {"PYTHONPATH": str(site)} if site is not None else {}
    return subprocess.run(
        [sys.executable, "-m", "omnicore.cli.main", *args],
        env=_clean_env(**extra, **env), capture_output=True, text=True, timeout=60,
    )


def plugins_json(site: Path | None, **env: str) -> tuple[dict, list[str]]:
    proc = run_cli(site, "plugins", "--json", **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), [line for line in proc.stderr.splitlines() if line.strip()]


def by_name(payload: dict) -> dict[str, dict]:
    return {p["name"]: p for p in payload["plugins"]}


def test_json_lists_core_and_installed_plugins_with_what_they_register(site):
    payload, _ = plugins_json(site)
    plugins = by_name(payload)
    tag = (site / "tag").read_text()
    core = plugins["omnicore"]
    assert core["status"] == "loaded" and core["dist"] == "omnicore"
    assert core["registered"]["platform"] == ["cpu"] and "sdpa" in core["registered"]["attention_backend"]
    alpha = plugins["alpha"]
    assert alpha["status"] == "loaded" and alpha["dist"] == f"omnitest-alpha-{tag}" and alpha["version"] == "0.5"
    assert alpha["registered"] == {"model": ["alpha-model"]}
    assert alpha["info"] == {"kind": "model", "api": ">=1.0,<2"}
    assert alpha["import_ms"] > 0
    assert payload["registries"]["model"]["alpha-model"] == "alpha"
    assert payload["registries"]["platform"]["cpu"] == "omnicore"
    assert payload["registries"]["attention_backend"]["sdpa"] == "omnicore"


def test_broken_plugin_is_failed_and_the_others_still_load(site):
    payload, stderr = plugins_json(site)
    plugins = by_name(payload)
    broken = plugins["broken"]
    assert broken["status"] == "failed"
    assert "ImportError: this plugin needs libmissing" in broken["error"]
    assert "Traceback" in broken["traceback"]
    assert plugins["alpha"]["status"] == plugins["beta"]["status"] == "loaded"
    assert [line for line in stderr if "'broken'" in line] == [f"error: plugin 'broken' FAILED: {broken['error']}"]


def test_table_marks_failed_plugins_and_reports_the_error_once_on_stderr(site):
    proc = run_cli(site, "plugins")
    assert proc.returncode == 0, proc.stderr
    plugin_table, platform_table = proc.stdout.split("\n\n")  # plugins, then platforms (availability, ops)
    rows = {line.split()[0]: line for line in plugin_table.splitlines() if line}
    assert rows["NAME"].split()[:4] == ["NAME", "DISTRIBUTION", "VERSION", "STATUS"]
    assert "FAILED" in rows["broken"] and "model: alpha-model" in rows["alpha"]
    payload, _ = plugins_json(site)
    assert set(rows) == {"NAME"} | set(by_name(payload))  # one row per plugin and nothing else
    platforms = {line.split()[0]: line.split() for line in platform_table.splitlines() if line}
    assert platforms["PLATFORM"][:4] == ["PLATFORM", "PROVIDER", "PRIORITY", "AVAILABLE"]
    assert set(platforms) == {"PLATFORM"} | {p["name"] for p in payload["platforms"]}
    assert platforms["cpu"][:4] == ["cpu", "omnicore", "0", "yes"]
    assert "libmissing" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "'broken'" in line]  # other installed plugins aside
    assert errors == ["error: plugin 'broken' FAILED: import of "
                      f"'omnitest_broken_{(site / 'tag').read_text()}' failed: ImportError: this plugin needs libmissing"]


def test_allow_list_env_var(site):
    payload, stderr = plugins_json(site, OMNICORE_PLUGINS="alpha")
    plugins = by_name(payload)
    assert plugins["alpha"]["status"] == "loaded"
    assert plugins["beta"]["status"] == plugins["broken"]["status"] == "disabled"
    assert "beta-model" not in payload["registries"]["model"]
    assert stderr == [] and payload["problems"] == []  # the broken plugin was never imported


def test_deny_list_env_var(site):
    payload, stderr = plugins_json(site, OMNICORE_DISABLE_PLUGINS="broken,beta")
    plugins = by_name(payload)
    assert (plugins["alpha"]["status"], plugins["beta"]["status"], plugins["broken"]["status"]) == (
        "loaded", "disabled", "disabled")
    assert not any("broken" in line or "beta" in line for line in stderr)

    payload, _ = plugins_json(site, OMNICORE_DISABLE_PLUGINS="*")
    assert {p["status"] for p in payload["plugins"] if p["name"] != "omnicore"} == {"disabled"}
    assert by_name(payload)["omnicore"]["status"] == "loaded"


def test_unknown_name_in_allow_list_is_one_clear_line(site):
    payload, stderr = plugins_json(site, OMNICORE_PLUGINS="alpha,ghost")
    assert len(stderr) == 1, stderr
    assert stderr[0].startswith("error: OMNICORE_PLUGINS names unknown plugin 'ghost'")
    assert payload["problems"] == [stderr[0].removeprefix("error: ")]
    assert by_name(payload)["alpha"]["status"] == "loaded"


def test_requirements_prints_installed_third_party_distributions(site):
    proc = run_cli(site, "plugins", "--requirements")
    tag = (site / "tag").read_text()
    lines = proc.stdout.splitlines()
    assert f"omnitest-alpha-{tag}==0.5" in lines and f"omnitest-broken-{tag}==0.6" in lines
    assert not any(line.startswith("omnicore==") for line in lines)


def test_help_and_version(site):
    proc = run_cli(site, "--help")
    assert proc.returncode == 0 and "plugins" in proc.stdout and "serve" in proc.stdout
    proc = run_cli(site, "--version")
    assert proc.returncode == 0
    assert proc.stdout.startswith("omnicore ") and "plugin API" in proc.stdout
    assert "alpha:" in proc.stdout and "[failed]" in proc.stdout


def test_invalid_trace_setting_is_reported_not_a_traceback(site):
    proc = run_cli(site, "plugins", OMNICORE_TRACE_PLUGINS="maybe")
    assert proc.returncode == 2
    assert "OMNICORE_TRACE_PLUGINS" in proc.stderr and "Traceback" not in proc.stderr


def test_trace_env_var_logs_registration_calls(site):
    proc = run_cli(site, "plugins", "--json", OMNICORE_TRACE_PLUGINS="1", OMNICORE_PLUGINS="alpha")
    assert proc.returncode == 0
    assert any(line.startswith("omnicore.trace: omnicore_register_models plugins=[alpha]")
               for line in proc.stderr.splitlines())


# ------------------------------------------------------------------------------------------- no torch


def _modules_after(code: str, site: Path | None = None) -> list[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(m for m in sys.modules)))"
    env = _clean_env(**({"PYTHONPATH": str(site)} if site else {}))
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_plugins_command_in_process_never_imports_torch(site):
    mods = _modules_after(
        "from omnicore.cli.main import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plugins', '--json']) == 0\n"
        "    assert main(['plugins']) == 0\n"
        "    assert main(['--version']) == 0\n",
        site,
    )
    assert "omnicore.plugin_host.host" in mods  # the command really ran
    assert [m for m in mods if m.split(".")[0] in HEAVY] == []


@pytest.mark.parametrize("module", ["omnicore", "omnicore.cli", "omnicore.cli.main", "omnicore.hookspecs",
                                    "omnicore.plugin_host", "omnicore.testing", "omnicore.testing.pytest_plugin",
                                    "omnicore.testing.platform", "omnicore.testing.cache"])
def test_importtime_shows_no_heavy_import(module):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          env=_clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert module in imported  # the probe measured what it claims to
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


# ------------------------------------------------------------------------------------------- bad input

def _fake_site(root: Path, dists: list[dict]) -> Path:
    """Write fake installed distributions: ``{"dist", "eps": {name: target}, "modules": {name: source},
    "requires": [...]}`` each."""
    root.mkdir()
    for d in dists:
        info = root / f"{d['dist'].replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        meta = f"Metadata-Version: 2.1\nName: {d['dist']}\nVersion: 0.1\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in d.get("requires", ()))
        (info / "METADATA").write_text(meta)
        (info / "entry_points.txt").write_text(
            "[omnicore]\n" + "".join(f"{n} = {t}\n" for n, t in d["eps"].items()))
        for module, source in d.get("modules", {}).items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def _model_dist(tag: str, dist: str, ep: str, model: str, info: str = ">=1.0,<2", **extra) -> dict:
    module = f"omnitest_{ep}_{tag}"
    source = MODEL_PLUGIN.format(model=model, module=module).replace(">=1.0,<2", info)
    return {"dist": f"omnitest-{dist}-{tag}", "eps": {ep: module}, "modules": {module: source}, **extra}


RAISES_IF_IMPORTED = "raise RuntimeError('this module must never be imported')\n"

# case -> (distributions besides the good "ok" plugin, env, regex of the ONE stderr line)
BAD_INPUT = {
    "unknown name in allow-list": (
        [], {"OMNICORE_PLUGINS": "ok,ghost"},
        r"error: OMNICORE_PLUGINS names unknown plugin 'ghost' \(installed: ([\w, ]+, )?ok(, [\w, ]+)?\)"),
    "unknown name in deny-list": (
        [], {"OMNICORE_DISABLE_PLUGINS": "ghost", "OMNICORE_PLUGINS": "ok"},
        r"error: OMNICORE_DISABLE_PLUGINS names unknown plugin 'ghost' \(installed: ([\w, ]+, )?ok(, [\w, ]+)?\)"),
    "malformed entry point": (
        [{"dist": "omnitest-mal-{tag}", "eps": {"mal": "not a valid target!"}}], {},
        r"error: plugin 'mal' FAILED: entry point value 'not a valid target!' is malformed \(expected 'package.module' or 'package.module:attr'\)"),
    "entry point naming a missing attribute": (
        [{"dist": "omnitest-attr-{tag}", "eps": {"noattr": "json:no_such_function"}}], {},
        r"error: plugin 'noattr' FAILED: import of 'json:no_such_function' failed: AttributeError: .*no_such_function.*"),
    "duplicate registration": (
        ["dupreg"], {},
        r"error: plugin '(first|second)' FAILED: DuplicateRegistration: model 'shared' is already registered "
        r"by plugin '(first|second)'"),
    "duplicate entry point name": (
        [{"dist": "omnitest-twin-a-{tag}", "eps": {"twin": "json"}},
         {"dist": "omnitest-twin-b-{tag}", "eps": {"twin": "json"}}], {},
        r"error: entry point name 'twin' is used by both omnitest-twin-(a|b)-\w+ and omnitest-twin-(a|b)-\w+; "
        r"skipping the one from omnitest-twin-(a|b)-\w+"),
    "Requires-Dist excludes this core": (
        [{"dist": "omnitest-old-{tag}", "eps": {"old": "omnitest_old_{tag}"}, "requires": ["omnicore<0.0.1"],
          "modules": {"omnitest_old_{tag}": RAISES_IF_IMPORTED}}], {},
        r"error: plugin 'old' INCOMPATIBLE: omnitest-old-\w+ 0\.1 requires omnicore<0\.0\.1 but this core is "
        r"omnicore [\w.]+; not imported"),
    "plugin API range excludes this core": (
        ["api"], {},
        r"error: plugin 'future' INCOMPATIBLE: plugin_info\(\)\['api'\] = '>=2,<3' does not admit this core's "
        r"plugin API [\d.]+"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gives_one_clear_error_line_naming_the_culprit(case, tmp_path):
    extra, env, pattern = BAD_INPUT[case]
    tag = uuid.uuid4().hex[:8]
    dists = [_model_dist(tag, "ok", "ok", "ok-model")]
    for d in extra:
        if d == "dupreg":
            dists += [_model_dist(tag, "first", "first", "shared"), _model_dist(tag, "second", "second", "shared")]
        elif d == "api":
            dists.append(_model_dist(tag, "future", "future", "future-model", info=">=2,<3"))
        else:
            fill = lambda v: v.replace("{tag}", tag)  # noqa: E731
            dists.append({"dist": fill(d["dist"]), "eps": {k: fill(v) for k, v in d["eps"].items()},
                          "requires": d.get("requires", []),
                          "modules": {fill(k): v for k, v in d.get("modules", {}).items()}})
    site = _fake_site(tmp_path / "site", dists)
    # only this site's plugins are allowed, so whatever else the venv has installed cannot add lines
    env = {"OMNICORE_PLUGINS": ",".join(n for d in dists for n in d["eps"]), **env}
    for args in (("plugins",), ("plugins", "--json")):
        proc = run_cli(site, *args, **env)
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert re.fullmatch(pattern, lines[0]), lines[0]
        if args[-1] == "--json":
            payload = json.loads(proc.stdout)
            assert payload["problems"] == [lines[0].removeprefix("error: ")]
            assert by_name(payload)["ok"]["status"] == "loaded"  # the rest still load
            assert payload["registries"]["model"]["ok-model"] == "ok"
        else:
            assert "error" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_a_replacement_is_listed_as_an_override(tmp_path):
    source = """
        from omnicore import hookimpl
        from omnicore.specs import AttentionBackendSpec

        @hookimpl
        def omnicore_register_attention_backends(register):
            register(AttentionBackendSpec(name="sdpa", impl="omnicore.attention.reference:sdpa_attention"),
                     replace=True)
    """
    tag = uuid.uuid4().hex[:8]
    site = _fake_site(tmp_path / "site", [{"dist": f"omnitest-over-{tag}", "eps": {"over": f"omnitest_over_{tag}"},
                                           "modules": {f"omnitest_over_{tag}": source}}])
    payload, stderr = plugins_json(site)
    assert stderr == []
    assert payload["overrides"] == [{"kind": "attention_backend", "name": "sdpa", "replaced": "omnicore", "by": "over"}]
    assert payload["registries"]["attention_backend"]["sdpa"] == "over"
    proc = run_cli(site, "plugins")
    assert "override: attention_backend 'sdpa' from 'omnicore' replaced by 'over'" in proc.stdout.splitlines()
