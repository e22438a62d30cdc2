"""A real server process serving a model pool of toy checkpoints, whose loads (and restores) take ``LOAD_DELAY_S``
seconds, so a test can kill it during a swap.

Run by ``test_multimodel_restart.py``: ``python _pool_server.py STATE_DIR CACHE_DIR PORT_FILE BUDGET
LOAD_DELAY_S NAME=DIR ...``. The port is written to PORT_FILE once the listener is up.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the toy plugin
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    state_dir, cache_dir, port_file, budget, delay = sys.argv[1:6]
    models = dict(arg.split("=", 1) for arg in sys.argv[6:])
    from _server_helpers import SlowSteps
    from omnicore.config import Settings
    from omnicore.pool import ModelEntry, ModelPool
    from omnicore.pool import pool as pool_module
    from omnicore.server import ServerSettings, create_app
    from omnicore.server.http_edge import uvicorn_config
    from omnicore.server.lifecycle import DrainingServer
    from toy import toy_host

    slow_load = float(delay)
    original = pool_module.ModelPool._load

    def slow(self: Any, slot: Any) -> None:  # a large checkpoint's load, stood in for by a pause
        if slot.entry.name != next(iter(self._slots)) or slot.engine is not None:  # the first preload stays fast
            time.sleep(slow_load)
        original(self, slot)

    pool_module.ModelPool._load = slow  # type: ignore[method-assign]
    settings = Settings(cache_dir=cache_dir)
    host = toy_host(settings)
    host.add_plugin(SlowSteps(0.1), "slow-steps")
    pool = ModelPool([ModelEntry(name=n, checkpoint=d) for n, d in models.items()], host=host, settings=settings,
                     memory_budget=int(budget))
    app = create_app(pool, ServerSettings(state_dir=state_dir, shutdown_grace_s=5, cancel_wait_s=5))
    config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning", read_timeout_s=30, shutdown_grace_s=5)
    server = DrainingServer(config, app.state.ctx)

    def announce() -> None:
        while not server.started:
            time.sleep(0.02)
        Path(port_file).write_text(str(server.servers[0].sockets[0].getsockname()[1]))

    threading.Thread(target=announce, daemon=True).start()
    server.run()


if __name__ == "__main__":
    main()
