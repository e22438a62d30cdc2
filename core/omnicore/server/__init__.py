"""The OpenAI-style HTTP server (``omnicore serve``). Import cost: FastAPI only here."""

from __future__ import annotations

from .app import ServerContext, create_app
from .settings import ServerSettings, server_settings_from
from .store import JobStore

__all__ = ["JobStore", "ServerContext", "ServerSettings", "create_app", "server_settings_from"]
