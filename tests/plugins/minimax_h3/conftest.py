"""Shared fixtures: the tiny repositories built once per session and loaded through the real loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _h3_helpers import load


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_minimax_h3.presets import build_tiny_fl2va

    return build_tiny_fl2va(tmp_path_factory.mktemp("tiny-h3"))


@pytest.fixture(scope="session")
def tiny_combined_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_minimax_h3.presets import build_tiny_combined

    return build_tiny_combined(tmp_path_factory.mktemp("tiny-h3-combined"))


@pytest.fixture(scope="session")
def pipe(tiny_dir: Path) -> Any:
    return load(tiny_dir)


@pytest.fixture(scope="session")
def combined(tiny_combined_dir: Path) -> Any:
    return load(tiny_combined_dir)
