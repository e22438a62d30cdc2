"""Every plugin in this repository keeps to the public surface: its package imports ``omnicore.plugin`` and
``omnicore.testing`` only (imports inside functions included) — the same rule the conformance kit applies to
third-party plugins (``PluginConformance.test_imports_only_public_omnicore_modules``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnicore.testing.imports import internal_imports

ROOT = Path(__file__).resolve().parents[2]
# (package, the directory holding it): the examples are not installed, so their directory goes on sys.path
PACKAGES = sorted((p.parent.name, p.parent.parent) for p in [*ROOT.glob("plugins/*/omni_*/__init__.py"),
                                                             *ROOT.glob("examples/*/omni_*/__init__.py")])


def test_the_repository_has_plugin_packages():
    names = {name for name, _ in PACKAGES}
    assert {"omni_lingbot", "omni_minimax_h3", "omni_hunyuan", "omni_backends_cuda", "omni_backends_npu",
            "omni_example_pixart"} <= names


@pytest.mark.parametrize("package,where", PACKAGES, ids=[name for name, _ in PACKAGES])
def test_plugin_imports_only_public_omnicore_modules(package, where, monkeypatch):
    monkeypatch.syspath_prepend(str(where))
    found = internal_imports([package])
    assert not found, "\n".join(found)


def test_the_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    pkg = tmp_path / "omni_leaky"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from omnicore.plugin import ModelSpec\n")
    (pkg / "pipeline.py").write_text("def load():\n    from omnicore.engine.api import Engine\n    return Engine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [f.rsplit(": ", 1)[1] for f in internal_imports(["omni_leaky"])] == ["omnicore.engine.api"]
    assert internal_imports(["omnicore"]) == []  # the core itself is the implementation
