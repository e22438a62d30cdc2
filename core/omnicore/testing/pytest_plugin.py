"""pytest plugin (entry point ``pytest11``): the ``omnicore_host`` fixture for plugin authors' tests.

Loaded into every pytest session of an environment where omnicore is installed, so it must stay cheap: it
imports no torch and builds nothing until a test asks for a fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..plugin_host.host import PluginHost


@pytest.fixture
def omnicore_host() -> Iterator[PluginHost]:
    """An isolated plugin host: the core's built-ins only, no entry points, settings from defaults (not env).

    Register what a test needs with ``omnicore_host.add_plugin(obj, "name")``.
    """
    from .plugin import isolated_host

    yield isolated_host()
