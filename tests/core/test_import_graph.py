"""The import graph of ``core/omnicore`` and ``plugins/*``: no cycle, no import from a lower layer to a higher one.

The graph is read statically (``ast``), so it sees every import: at module level, inside functions (they run
later, but they are dependencies all the same: a lower layer that imports a higher one inside a function is the
same knot as one at the top) and under ``if TYPE_CHECKING:``. Those last never run, and a contract may name the
types it is called with: ``hookspecs`` names ``engine.protocol.Pipeline``. So they are kept apart: they may point
up only at the few record modules in :data:`TYPE_ONLY_TARGETS`, and they take no part in the cycle check.

Layers of the core, lowest first (a module may import its own layer and every layer below; the most specific
prefix names a module's layer):

0. **base** — errors, ids, phases, versions, the lazy-import helper, the op vocabulary (``ops.names``), the JSON
   value types (``json_types``): no
   dependency on anything else of omnicore.
1. **records** — settings (``config``), registry, the spec records, hook specifications, the LoRA records the
   model spec carries, checkpoints and tiny-checkpoint helpers, the package root, the core's own plugin
   (``_builtin``: records only, registered by the host).
2. **kernels** — ops tables and eager references, attention, platforms, module hooks, offload, outputs, media,
   VAE fast paths, regional compile, quantization, the parallel *primitives* (config, context, collectives,
   cfg, ulysses, tensor/expert parallel), the LoRA runtime, adapters for other libraries.
3. **techniques** — cache methods (they drive offload and module hooks), the memory pool's weight swap.
4. **host** — the plugin host (discovery, selection, failure isolation).
5. **engine core** — requests, the pipeline protocol, inputs, limits, jobs, progress, scheduler, runner, the load
   sequence (``engine.loading``), model options, warm-up; the planner's model source (it resolves models as the
   engine does) and its hub reader.
6. **engine runtime** — the parallel worker group (``parallel.worker``/``group``/``launch``: it loads through
   ``engine.loading``), planning and memory admission, quantization (it reads the model's declared targets
   through the planner's model source).
7. **engine** — ``engine.api`` (the ``Engine``: loads, starts the worker group, runs batches) and the model pool.
8. **front** — the CLI, the HTTP server and its job stores, the public plugin surface (``omnicore.plugin``) and
   the conformance kit (``omnicore.testing``).

Plugins (``plugins/*/``) sit above all of it; a plugin's own modules must not import each other in a circle, and
the core never imports a plugin. Which ``omnicore`` modules a plugin may import is test_plugin_boundary's rule.

``ALLOWED`` lists the edges that break these rules today and could not move yet, each with the reason; keep it
short. Run ``python tests/core/test_import_graph.py`` to print the layer of every module and every violation.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "omnicore"
PLUGINS = ROOT / "plugins"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("omnicore._version", "omnicore._lazy", "omnicore.errors", "omnicore.ids", "omnicore.phases",
              "omnicore.ops.names", "omnicore.json_types")),
    ("records", ("omnicore", "omnicore.config", "omnicore.registry", "omnicore.specs", "omnicore.hookspecs",
                 "omnicore.lora.records", "omnicore.lora.errors", "omnicore.blocks", "omnicore.checkpoint",
                 "omnicore.tiny_checkpoints", "omnicore._builtin")),
    ("kernels", ("omnicore.ops", "omnicore.attention", "omnicore.platforms", "omnicore.module_hooks",
                 "omnicore.offload", "omnicore.outputs", "omnicore.media", "omnicore.vae_fast_paths",
                 "omnicore.regional_compile", "omnicore.parallel", "omnicore.lora",
                 "omnicore.integrations")),
    ("techniques", ("omnicore.cache", "omnicore.pool.memory")),
    ("host", ("omnicore.plugin_host",)),
    ("engine core", ("omnicore.engine", "omnicore.planning.source", "omnicore.planning.hub",
                     "omnicore.planning.headers")),
    ("engine runtime", ("omnicore.parallel.worker", "omnicore.parallel.group", "omnicore.parallel.launch",
                        "omnicore.planning", "omnicore.quantization")),
    ("engine", ("omnicore.engine.api", "omnicore.pool")),
    ("front", ("omnicore.cli", "omnicore.server", "omnicore.jobstore", "omnicore.plugin", "omnicore.testing")),
)

#: What an ``if TYPE_CHECKING:`` import of a lower layer may name above it: the records hook implementations and
#: pipelines are called with (requests, the pipeline protocol and its options, outputs).
TYPE_ONLY_TARGETS = frozenset({"omnicore.engine.protocol", "omnicore.engine.request", "omnicore.outputs.output"})

#: (importer, imported): edges that break a rule today, each with why it has not moved yet. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imports(path: Path, module: str, known: set[str]) -> Iterator[tuple[str, str, int]]:
    """``(imported module, kind, line)`` for every import in ``path``; kind is ``top``, ``function`` or
    ``type`` (under ``if TYPE_CHECKING:``). ``from pkg import name`` points at ``pkg.name`` when that is a
    module, else at ``pkg``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
            return
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base

    def walk(nodes: list[ast.stmt] | list[ast.AST], kind: str) -> Iterator[tuple[str, str, int]]:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "type")
                yield from walk(node.orelse, kind)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets(node):
                    yield target, kind, node.lineno
                continue
            inner = "function" if kind == "top" and isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
            yield from walk(list(ast.iter_child_nodes(node)), inner)

    yield from walk(ast.parse(path.read_text()).body, "top")


def _sources() -> dict[str, Path]:
    """Every module of the core and of each plugin package (``plugins/<dist>/<package>/``), by dotted name."""
    found = {_module_name(p, CORE.parent): p for p in CORE.rglob("*.py")}
    for dist in sorted(PLUGINS.iterdir()):
        for pkg in sorted(dist.iterdir()):
            if (pkg / "__init__.py").is_file():
                found.update({_module_name(p, dist): p for p in pkg.rglob("*.py")})
    return found


def build_graph() -> dict[str, dict[str, tuple[str, int]]]:
    """``{importer: {imported: (kind, line)}}`` over the modules of :func:`_sources` (the strongest kind of
    each edge: ``top`` over ``function`` over ``type``). An import of a module's own ancestor package is left
    out (Python runs it first anyway; it is how packages work, not a dependency)."""
    sources = _sources()
    known = set(sources)
    rank = {"top": 0, "function": 1, "type": 2}
    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for name, path in sources.items():
        edges: dict[str, tuple[str, int]] = {}
        for target, kind, line in _imports(path, name, known):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if not target or target == name or name.startswith(target + "."):
                continue
            if target not in edges or rank[kind] < rank[edges[target][0]]:
                edges[target] = (kind, line)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (most specific prefix); ``None`` for a module outside the core."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def _is_core(module: str) -> bool:
    return module == "omnicore" or module.startswith("omnicore.")


def find_cycles(graph: dict[str, dict[str, tuple[str, int]]], kinds: set[str]) -> list[list[str]]:
    """Strongly connected components with more than one module, over edges of ``kinds``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, (kind, _) in graph.get(v, {}).items():
            if kind not in kinds or (v, w) in ALLOWED:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_edges(graph: dict[str, dict[str, tuple[str, int]]], kinds: set[str]) -> list[str]:
    out = []
    for importer, edges in sorted(graph.items()):
        low = layer_of(importer)
        if low is None:
            continue
        for imported, (kind, line) in sorted(edges.items()):
            high = layer_of(imported)
            if kind in kinds and high is not None and high > low and (importer, imported) not in ALLOWED:
                out.append(f"{importer} ({LAYERS[low][0]}) -> {imported} ({LAYERS[high][0]}), {kind} import at "
                           f"line {line}")
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, tuple[str, int]]]:
    return build_graph()


def test_every_core_module_has_a_layer(graph):
    missing = sorted(m for m in graph if _is_core(m) and layer_of(m) is None)
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_no_import_cycle_in_core_or_plugins(graph):
    cycles = find_cycles(graph, {"top", "function"})
    assert not cycles, "import cycles (module-level and function-level imports):\n" + "\n".join(map(str, cycles))


def test_no_upward_import_in_core(graph):
    upward = upward_edges(graph, {"top", "function"})
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def test_type_only_imports_point_up_only_at_records(graph):
    upward = [line for line in upward_edges(graph, {"type"})
              if line.split(" -> ")[1].split(" ")[0] not in TYPE_ONLY_TARGETS]
    assert not upward, "a TYPE_CHECKING import names a higher layer's module:\n" + "\n".join(upward)


def test_core_never_imports_a_plugin(graph):
    bad = sorted(f"{a} -> {b}" for a, edges in graph.items() if _is_core(a) for b in edges if not _is_core(b))
    assert not bad, bad


def test_plugins_never_import_each_other(graph):
    def package(module: str) -> str:
        return module.partition(".")[0]

    bad = sorted(f"{a} -> {b}" for a, edges in graph.items() if not _is_core(a) for b in edges
                 if not _is_core(b) and package(b) != package(a))
    assert not bad, bad


def test_allowed_edges_still_exist(graph):
    """An allow-list entry whose edge is gone is deleted, so the list only ever shrinks."""
    stale = [edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], {})]
    assert not stale, f"remove these ALLOWED entries, the import is gone: {stale}"


def test_the_checker_sees_function_level_and_upward_imports(tmp_path):
    """The reader itself: an import inside a function and a relative ``from . import module`` both count."""
    pkg = tmp_path / "omnicore"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from .engine import api\n")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "api.py").write_text("from .. import errors\n")
    known = {"omnicore", "omnicore.errors", "omnicore.engine", "omnicore.engine.api"}
    assert list(_imports(pkg / "errors.py", "omnicore.errors", known)) == [("omnicore.engine.api", "function", 2)]
    assert list(_imports(pkg / "engine" / "api.py", "omnicore.engine.api", known)) == [("omnicore.errors", "top", 1)]
    toy = {"omnicore.errors": {"omnicore.engine.api": ("function", 2)},
           "omnicore.engine.api": {"omnicore.errors": ("top", 1)}}
    assert find_cycles(toy, {"top", "function"}) == [["omnicore.engine.api", "omnicore.errors"]]
    assert upward_edges(toy, {"top", "function"}) and not upward_edges(toy, {"top"})


if __name__ == "__main__":  # print the layers and every finding
    g = build_graph()
    for m in sorted(g):
        if _is_core(m):
            layer = layer_of(m)
            print(f"{LAYERS[layer][0] if layer is not None else '??':15} {m}")
    print("cycles:", find_cycles(g, {"top", "function"}))
    print("upward (run time):", *upward_edges(g, {"top", "function"}), sep="\n  ")
    print("upward (TYPE_CHECKING only):", *upward_edges(g, {"type"}), sep="\n  ")
