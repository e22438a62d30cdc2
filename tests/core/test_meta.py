"""Meta-tests: every hook is documented and tested; every OMNICORE_* setting is declared and documented once."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import omnicore
from omnicore import hookspecs
from omnicore.config import OPTIONS

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
FIXED_HOOKS = {  # DESIGN §3: these names are the public contract
    "omnicore_register_models", "omnicore_register_platforms", "omnicore_register_attention_backends",
    "omnicore_register_cache_methods", "omnicore_preprocess", "omnicore_denoise", "omnicore_cache",
    "omnicore_attention_backend", "omnicore_postprocess",
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
    assert inspect.signature(func).return_annotation is not inspect.Signature.empty, f"{hook}: no return annotation"


def _test_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in TESTS.rglob("test_*.py") if p.name != "test_meta.py"}


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    users = [p.relative_to(REPO) for p, text in _test_sources().items() if re.search(rf"\b{hook}\b", text)]
    assert users, f"no test under tests/ uses {hook}"


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
