"""The three native model plugins share one template: the same file names for the same concepts.

A reader who knows one plugin finds the sampler, the conditioning, the request rules and the model code of the
others at the same paths; the guide (docs/writing-a-model-plugin.md, "The native template") documents it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: distribution folder under plugins/ -> import package
MODEL_PLUGINS = {"lingbot": "omni_lingbot", "minimax_h3": "omni_minimax_h3", "hunyuan": "omni_hunyuan"}

#: every native model plugin has these, each holding the same concept
TEMPLATE = (
    "plugin.py",          # entry module: registrations only, no torch
    "presets.py",         # tiny:/real: presets
    "detect.py",          # checkpoint detection
    "loader.py",          # checkpoint -> modules
    "pipeline.py",        # the engine protocol
    "request_rules.py",   # request defaults and validation
    "sampler.py",         # the noise schedule and the update rule
    "conditions.py",      # conditioning inputs (images, references)
    "vae.py",             # the autoencoder and its fast paths
    "transformer/__init__.py",
    "transformer/config.py",
    "transformer/model.py",
    "transformer/blocks.py",
    "transformer/attention.py",
    "transformer/rope.py",
    "transformer/layout.py",
)

#: names the template replaced: a plugin growing one of them again splits a concept over two names
RETIRED = ("scheduler.py", "image_condition.py", "vision.py", "modules.py", "model.py", "transformer/plan.py",
           "transformer/block.py")

#: each plugin's CLI and server tests live with its other tests
TEST_TEMPLATE = ("test_cli.py", "test_server.py", "test_plugin.py", "test_pipeline.py")


@pytest.mark.parametrize("folder", sorted(MODEL_PLUGINS))
def test_plugin_tree_follows_the_template(folder: str) -> None:
    package = ROOT / "plugins" / folder / MODEL_PLUGINS[folder]
    missing = [name for name in TEMPLATE if not (package / name).is_file()]
    assert not missing, f"plugins/{folder} lacks template files {missing}"
    retired = [name for name in RETIRED if (package / name).exists()]
    assert not retired, f"plugins/{folder} has retired file names {retired} (see the template in the plugin guide)"


@pytest.mark.parametrize("folder", sorted(MODEL_PLUGINS))
def test_plugin_tests_live_under_tests_plugins(folder: str) -> None:
    tests = ROOT / "tests" / "plugins" / folder
    missing = [name for name in TEST_TEMPLATE if not (tests / name).is_file()]
    assert not missing, f"tests/plugins/{folder} lacks {missing}"
    elsewhere = sorted(p.relative_to(ROOT).as_posix() for d in ("e2e", "server", "core")
                       for p in (ROOT / "tests" / d).glob(f"test_*{folder}*.py"))
    assert not elsewhere, f"tests of plugin {folder} outside tests/plugins/{folder}: {elsewhere}"


def test_the_guide_lists_every_template_file() -> None:
    guide = (ROOT / "docs" / "writing-a-model-plugin.md").read_text()
    assert "## The native template" in guide
    missing = [name for name in TEMPLATE if f"`{name}`" not in guide]
    assert not missing, f"the guide's template section does not name {missing}"


def test_the_host_package_is_not_named_like_the_public_module() -> None:
    core = ROOT / "core" / "omnicore"
    assert (core / "plugin_host").is_dir() and not (core / "plugins").exists()
