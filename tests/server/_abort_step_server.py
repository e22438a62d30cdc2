"""A real server process (uvicorn in the main thread, signals and all) on the toy model, whose denoise step
raises ``SystemExit`` or ``KeyboardInterrupt`` for requests tagged ``model_params.tag = "exit"`` / ``"interrupt"``.

Run by ``test_hardening_jobs.py``: ``python _abort_step_server.py STATE_DIR CACHE_DIR PORT_FILE``. The port is
written to PORT_FILE once the listener is up; access logs go to stderr at INFO (the test reads them).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from omnicore.hookspecs import hookimpl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the toy plugin
sys.path.insert(0, str(Path(__file__).resolve().parent))


class AbortingStep:
    """Raises a ``BaseException`` that is not an ``Exception`` from inside the denoise hook."""

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        tags = {r.extra.get("tag") for r in state.requests}
        if "exit" in tags:
            raise SystemExit(3)
        if "interrupt" in tags:
            raise KeyboardInterrupt
        time.sleep(0.05)
        return (yield)


def main() -> None:
    state_dir, cache_dir, port_file = sys.argv[1:4]
    from omnicore.config import Settings
    from omnicore.server import ServerSettings, create_app
    from omnicore.server.http_edge import uvicorn_config
    from omnicore.server.lifecycle import DrainingServer
    from toy import toy_engine, toy_host

    host = toy_host(Settings(cache_dir=cache_dir))
    host.add_plugin(AbortingStep(), "aborting-step")
    engine = toy_engine(cache_dir, host=host, max_num_seqs=1)
    settings = ServerSettings(state_dir=state_dir, api_keys=("abort-test-key-0123456789",), shutdown_grace_s=5,
                              cancel_wait_s=5)
    app = create_app(engine, settings)
    config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="info", read_timeout_s=30,
                            shutdown_grace_s=5)
    server = DrainingServer(config, app.state.ctx)

    def announce() -> None:
        while not server.started:
            time.sleep(0.02)
        Path(port_file).write_text(str(server.servers[0].sockets[0].getsockname()[1]))

    threading.Thread(target=announce, daemon=True).start()
    server.run()


if __name__ == "__main__":
    main()
