"""``omnicore.plugin`` type-checks as what it returns: a plugin that imports only the public module gets the core's
real types from mypy, not ``Any`` from the module's lazy ``__getattr__``.

The ``if TYPE_CHECKING:`` block of ``omnicore/plugin.py`` imports the object behind every lazy name; the first test
keeps it in step with the ``_LAZY`` table (a name added to one and not the other fails here, naming it), the second
runs mypy on a small plugin-like module and checks that it sees real types and rejects a bad call.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN_PY = Path(__file__).resolve().parents[2] / "core" / "omnicore" / "plugin.py"


def _typed_view() -> dict[str, str]:
    """name -> "omnicore.module:attr" for every import inside ``if TYPE_CHECKING:``."""
    tree = ast.parse(PLUGIN_PY.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.dump(imp)
                for alias in imp.names:
                    name = alias.asname or alias.name
                    assert alias.asname == alias.name or alias.asname is not None
                    if imp.module is None:  # ``from . import ops as ops``: a whole module
                        found[name] = f"omnicore.{alias.name}"
                    else:
                        found[name] = f"omnicore.{imp.module}:{alias.name}"
    return found


def test_the_typed_view_imports_every_lazy_name_from_its_home():
    from omnicore.plugin import _LAZY

    view = _typed_view()
    missing = sorted(set(_LAZY) - set(view))
    extra = sorted(set(view) - set(_LAZY))
    assert not missing, f"add to plugin.py's TYPE_CHECKING block: {missing}"
    assert not extra, f"in the TYPE_CHECKING block but not exported through _LAZY: {extra}"
    wrong = {n: (view[n], _LAZY[n]) for n in _LAZY if view[n] != _LAZY[n]}
    assert not wrong, f"the typed view and _LAZY disagree on where these come from: {wrong}"


@pytest.mark.slow
def test_mypy_sees_real_types_through_the_public_module(tmp_path):
    src = tmp_path / "third_party_plugin.py"
    src.write_text(textwrap.dedent("""
        from omnicore.plugin import MAX_SEED, InvalidRequest, ModelSpec

        reveal_type(InvalidRequest)
        reveal_type(MAX_SEED)
        ModelSpec(no_such_field=1)
    """))
    # MYPYPATH: the editable install's import hook is invisible to mypy, so point it at the source tree
    env = {**os.environ, "MYPYPATH": str(PLUGIN_PY.parents[1])}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                           "--ignore-missing-imports", "--cache-dir", str(tmp_path / ".mypy_cache"), str(src)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    out = proc.stdout
    assert "omnicore.errors.InvalidRequest" in out, out
    assert 'Revealed type is "int"' in out or 'Revealed type is "builtins.int"' in out, out
    assert 'Unexpected keyword argument "no_such_field"' in out, out
    assert "Any" not in "\n".join(line for line in out.splitlines() if "Revealed type" in line), out
