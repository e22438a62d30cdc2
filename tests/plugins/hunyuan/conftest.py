"""Shared fixtures: a micro checkpoint (the tiny preset's architecture at image base 64, so 64x64 images decode
in well under a second) built once per session and loaded through the real loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _hunyuan_helpers import load


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_hunyuan.presets import build_tiny

    return build_tiny(tmp_path_factory.mktemp("hunyuan-micro"), base_size=64)


@pytest.fixture(scope="session")
def pipe(micro_dir: Path) -> Any:
    return load(micro_dir)


@pytest.fixture(scope="session")
def paged_pipe(micro_dir: Path) -> Any:
    return load(micro_dir, kv_mode="paged_scheduler", kv_block_size=8, kv_pool_blocks=64)
