"""Copies that were folded into one helper stay folded (issue 18, "Boilerplate into the core").

The source of ``core/omnicore`` and ``plugins/*`` is read with ``ast`` (nothing is imported). Two kinds of check:

- a general one: no function body of three or more lines stands, statement for statement, in two modules
  (``KNOWN_COPIES`` lists the few left, each with the reason it stays);
- one per copy the review named, for the shapes the general check cannot see (module-level tails, one-line
  helpers, constructor calls): each names the helper to use instead.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "omnicore"
PLUGINS = ROOT / "plugins"

#: the shortest function body (in source lines, docstring excluded) the general check compares
MIN_LINES = 3

#: {(module, function), (module, function)} pairs that are copies today, with why they stay
KNOWN_COPIES: dict[frozenset[tuple[str, str]], str] = {
    frozenset({("plugins/hunyuan/omni_hunyuan/transformer/blocks.py", "__init__"),
               ("plugins/lingbot/omni_lingbot/transformer/ffn.py", "__init__")}):
        "each model's SwiGLU MLP is its own module: its parameter names are that checkpoint's keys",
    frozenset({("plugins/lingbot/omni_lingbot/transformer/config.py", "_int_tuple"),
               ("plugins/minimax_h3/omni_minimax_h3/transformer/config.py", "_int_tuple")}):
        "a two-line attrs converter of each model's config record",
    frozenset({("plugins/lingbot/omni_lingbot/pipeline.py", "sparse_attention_options"),
               ("plugins/minimax_h3/omni_minimax_h3/pipeline.py", "sparse_attention_options")}):
        "both read the same two rainfusion model options; they move with those option declarations into the "
        "core when a third model needs them",
    frozenset({("core/omnicore/parallel/group.py", "_free_port"),
               ("core/omnicore/testing/postgres.py", "_free_port")}):
        "the worker group and the throwaway PostgreSQL cluster each bind a free port; two layers apart",
    frozenset({("core/omnicore/server/store.py", "inputs_dir"),
               ("core/omnicore/jobstore/storage.py", "inputs_dir")}):
        "the server's store and the shared-storage job store name the same folder; the store contract moves "
        "into omnicore.jobstore",
}


def _sources() -> Iterator[tuple[str, ast.Module, str]]:
    for base in (CORE, PLUGINS):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/tests/" in rel or "/build/" in rel:
                continue
            text = path.read_text(encoding="utf-8")
            try:
                yield rel, ast.parse(text), text
            except SyntaxError:  # another change half-written: the import-graph test reports it
                continue


SOURCES = list(_sources())


def _body(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


@functools.cache
def copied_functions(min_lines: int = MIN_LINES) -> dict[frozenset[tuple[str, str]], list[str]]:
    """Pairs of functions in different modules whose bodies are the same statements (names and values included)."""
    places: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for rel, tree, _ in SOURCES:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = _body(node)
                if body and (body[-1].end_lineno or 0) - body[0].lineno + 1 >= min_lines:
                    places["\n".join(ast.dump(stmt) for stmt in body)].add((rel, node.name))
    pairs: dict[frozenset[tuple[str, str]], list[str]] = {}
    for where in places.values():
        ordered = sorted(where)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                if a[0] != b[0]:
                    pairs[frozenset({a, b})] = [f"{m}:{f}" for m, f in (a, b)]
    return pairs


def test_no_function_body_stands_in_two_modules() -> None:
    found = copied_functions()
    new = sorted(" ~ ".join(v) for k, v in found.items() if k not in KNOWN_COPIES)
    assert not new, ("the same function body stands in two modules; keep one (a core helper exported from "
                     "omnicore.plugin when plugins share it) or list it in KNOWN_COPIES with the reason:\n"
                     + "\n".join(new))


def test_every_known_copy_still_exists() -> None:
    """A copy that was folded comes off the list, so the list stays the truth."""
    gone = sorted(" ~ ".join(sorted(f"{m}:{f}" for m, f in k)) for k in KNOWN_COPIES if k not in copied_functions())
    assert not gone, "folded copies still listed in KNOWN_COPIES:\n" + "\n".join(gone)


def test_the_check_sees_a_copy() -> None:
    code = "def helper(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    a, b = ast.parse(code), ast.parse(code.replace("helper", "other"))
    assert [ast.dump(s) for s in _body(a.body[0])] == [ast.dump(s) for s in _body(b.body[0])]  # type: ignore[arg-type]


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (node for node in ast.walk(tree) if isinstance(node, ast.Call))


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}" if owner else func.attr
    return ""


def _where(predicate: object, *, skip: tuple[str, ...] = ()) -> list[str]:
    """``module:line`` of every call ``predicate(call)`` accepts, outside the modules in ``skip``."""
    out = []
    for rel, tree, _ in SOURCES:
        if rel in skip:
            continue
        out += [f"{rel}:{c.lineno}" for c in _calls(tree) if predicate(c)]  # type: ignore[operator]
    return out


def _defs(name: re.Pattern[str]) -> list[str]:
    return [f"{rel}:{node.lineno} {node.name}" for rel, tree, _ in SOURCES for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name.fullmatch(node.name)]


def test_model_plugins_derive_their_entry_tail() -> None:
    """Entry modules that register models call ``model_plugin(...)`` instead of writing plugin_info + the hook."""
    hand_written = []
    for rel, tree, text in SOURCES:
        if not rel.startswith("plugins/") or not rel.endswith("/plugin.py") or "ModelSpec(" not in text:
            continue
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if names & {"plugin_info", "omnicore_register_models"} or "model_plugin(" not in text:
            hand_written.append(rel)
    assert not hand_written, f"write `plugin_info, omnicore_register_models = model_plugin(...)`: {hand_written}"


def test_attention_requirements_come_from_load_options() -> None:
    """Loaders ask ``LoadOptions.select_attention`` / ``attention_requirement`` (platform and dtype name filled)."""
    names = [(d.split(":")[0], d.split(" ")[1]) for d in _defs(re.compile(r"_?dtype_name"))]
    assert names == [("core/omnicore/specs.py", "dtype_name")], f"one dtype_name (omnicore.specs): {names}"
    built = _where(lambda c: _callee(c) == "AttentionRequirement",
                   skip=("core/omnicore/engine/protocol.py",))
    built = [w for w in built if not w.startswith("core/omnicore/testing/")]  # the kit builds them per platform
    assert not built, f"AttentionRequirement(...) built by hand (use options.select_attention): {built}"


def test_one_size_parser() -> None:
    assert [d.split(" ")[1] for d in _defs(re.compile(r"parse_size\w*"))] == ["parse_size_wh"]


def test_one_image_magic_table() -> None:
    png = [f"{rel}:{node.lineno}" for rel, tree, _ in SOURCES for node in ast.walk(tree)
           if isinstance(node, ast.Constant) and isinstance(node.value, bytes) and node.value.startswith(b"\x89PNG")]
    assert [w.split(":")[0] for w in png] == ["core/omnicore/media.py"], png


def test_one_seed_draw() -> None:
    draws = _where(lambda c: _callee(c).split(".")[-1] in ("randrange", "randint", "randbelow", "getrandbits")
                   and not _callee(c).startswith(("torch.", "np.", "numpy.")),
                   skip=("core/omnicore/engine/request.py",))
    assert not draws, f"a seed drawn outside engine.request.random_seed: {draws}"


def test_qwen3_vl_is_loaded_and_built_in_one_place() -> None:
    here = ("core/omnicore/integrations/qwen3_vl.py",)
    loads = _where(lambda c: _callee(c) in ("Qwen3VLForConditionalGeneration.from_pretrained",
                                            "Qwen2VLImageProcessorPil"), skip=here)
    assert not loads, f"use omnicore.plugin.load_qwen3_vl / build_tiny_qwen3_vl: {loads}"


@pytest.mark.parametrize("pattern", [r"waveform\.shape\[-?1\]\s*/"])
def test_audio_durations_come_from_the_clip(pattern: str) -> None:
    found = [f"{rel}" for rel, _, text in SOURCES if rel != "core/omnicore/media.py" and re.search(pattern, text)]
    assert not found, f"use AudioClip.duration_s: {found}"
