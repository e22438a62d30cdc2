"""``omnicore plan`` on a Hub repository's metadata: configs and safetensors headers over HTTP range reads, no
tensor data. Tested on local files (``file://``) and on a real loopback HTTP server that answers the two Hub
routes the planner uses (the file list, and ranged file reads); nothing is mocked."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from omnicore.errors import InvalidRequest  # noqa: E402
from omnicore.planning.hub import header_only, read_header_at  # noqa: E402
from omnicore.planning.source import ByteCounter, read_safetensors_header  # noqa: E402


class RepoServer:
    """Serves ``root`` as Hub repository ``org/tiny`` on 127.0.0.1: ``/api/models/org/tiny/revision/<rev>`` (the
    file list) and ``/org/tiny/resolve/<rev>/<file>`` (byte ranges honoured); counts the bytes sent per file."""

    def __init__(self, root: Path, repo: str = "org/tiny") -> None:
        self.root, self.repo, self.sent = root, repo, {}  # type: ignore[var-annotated]
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path.startswith(f"/api/models/{server.repo}"):
                    files = sorted(str(p.relative_to(server.root)) for p in server.root.rglob("*") if p.is_file())
                    body = json.dumps({"id": server.repo, "sha": "0" * 40,
                                       "siblings": [{"rfilename": f} for f in files]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                prefix = f"/{server.repo}/resolve/"
                if not path.startswith(prefix):
                    self.send_error(404)
                    return
                name = path[len(prefix):].split("/", 1)[1]
                data = (server.root / name).read_bytes()
                rng = self.headers.get("Range")
                if rng:
                    a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                    chunk = data[a:b + 1]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {a}-{a + len(chunk) - 1}/{len(data)}")
                else:
                    chunk = data
                    self.send_response(200)
                server.sent[name] = server.sent.get(name, 0) + len(chunk)  # before the client can read it
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                self.wfile.write(chunk)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RepoServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _weights(tmp: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp / "w.safetensors"
    save_file({"a": torch.zeros(256, 256), "b": torch.zeros(3, dtype=torch.bfloat16)}, str(path))
    return path


def test_header_reader_on_a_file_url_reads_the_header_only(tmp_path: Path) -> None:
    path = _weights(tmp_path)
    counter = ByteCounter()
    raw = read_header_at(path.as_uri(), counter)
    size = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert raw == path.read_bytes()[:size] and counter.read == size < path.stat().st_size // 100
    assert json.loads(raw[8:]).keys() >= read_safetensors_header(path).keys()


def test_header_reader_over_http_and_a_server_without_ranges(tmp_path: Path) -> None:
    path = _weights(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    path.rename(repo / "w.safetensors")
    with RepoServer(repo) as srv:
        counter = ByteCounter()
        raw = read_header_at(f"{srv.url}/org/tiny/resolve/main/w.safetensors", counter)
        assert srv.sent["w.safetensors"] == counter.read == len(raw)
        assert len(raw) < (repo / "w.safetensors").stat().st_size // 100

    class NoRanges(SimpleHTTPRequestHandler):  # http.server sends whole files: it has no Range support
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, directory=str(repo), **k)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoRanges)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(InvalidRequest, match="did not honour a byte range"):
            read_header_at(f"http://127.0.0.1:{httpd.server_address[1]}/w.safetensors")
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture()
def tiny_repo(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    from omnicore.config import resolve_settings
    from omnicore.engine.loading import ensure_preset, find_preset
    from omnicore.plugin_host.host import PluginHost

    pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
    settings = resolve_settings({"cache_dir": str(tmp_path / "cache")})
    host = PluginHost(settings)
    spec, preset = find_preset(host, "tiny:lingbot")
    yield Path(ensure_preset(spec, preset, settings.cache_path)), (host, settings)


def test_plan_of_a_hub_repo_equals_the_local_plan_and_reads_headers_only(
        tiny_repo: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from omnicore.cli.plan_cmd import build_plan

    root, (host, settings) = tiny_repo
    local = build_plan(str(root), host=host, settings=settings)
    with RepoServer(root) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        remote = build_plan("org/tiny", host=host, settings=settings)
    weights = sorted(root.rglob("*.safetensors"))
    names = {str(p.relative_to(root)) for p in weights}
    headers = sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in weights)
    assert weights and sum(srv.sent[n] for n in names) == headers == remote.header_bytes_read
    assert headers < sum(p.stat().st_size for p in weights) / 2  # no tensor data crossed the wire
    assert remote.source == "hub" and remote.spec == local.spec
    assert remote.components == local.components
    assert [p.to_json() for p in remote.placements] == [p.to_json() for p in local.placements]
    mirror = next((Path(settings.cache_path) / "plan-metadata").iterdir())
    assert all(header_only(p) for p in mirror.rglob("*.safetensors"))


def test_unknown_hub_repo_is_one_clear_error(tiny_repo: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from omnicore.cli.plan_cmd import build_plan

    root, (host, settings) = tiny_repo
    with RepoServer(root, repo="org/other") as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        with pytest.raises(InvalidRequest, match="cannot read the file list of Hub repository 'org/tiny'"):
            build_plan("org/tiny", host=host, settings=settings)
