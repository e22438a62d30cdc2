"""Shared fixtures: the tiny presets built once per session and loaded through the real loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _lingbot_helpers import load


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_lingbot.presets import build_tiny_lingbot

    return build_tiny_lingbot(tmp_path_factory.mktemp("tiny-lingbot"))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_lingbot.presets import build_tiny_lingbot_moe

    return build_tiny_lingbot_moe(tmp_path_factory.mktemp("tiny-lingbot-moe"))


@pytest.fixture(scope="session")
def pipe(tiny_dir: Path) -> Any:
    return load(tiny_dir)
