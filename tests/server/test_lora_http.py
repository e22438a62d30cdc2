"""HTTP LoRA (issue 22): ``lora: [{"name"|"path", "scale"}]`` on images (generations, edits) and videos, through
httpx and the openai SDK's ``extra_body`` (JSON, a multipart JSON string, and the SDK's ``lora[][name]`` form
fields), every refusal a 400 before the request is queued, ``/v1/models`` listing the preloaded adapters and
``/metrics`` the registry's counters — against a real uvicorn serving toy models whose MLP linears take adapters.

The toy outputs noise; the checks are equalities: an HTTP request with adapters equals the Python API with the same
adapters on the same engine, scale 0 equals no adapter bit for bit, and an adapter changes the output.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import warnings

import attrs
import av
import httpx
import numpy as np
import pytest
import torch
from _lora_files import TOY_LINEARS, write_kohya, write_peft
from _server_helpers import LiveServer
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.lora import AdapterRegistry, LoRA, LoRATargets
from PIL import Image
from toy import ToyPlugin, toy_host
from toy.media import TOY_MEDIA_SPEC, write_png

TARGETS = LoRATargets(modules=("mlp.*", "time_proj"), root="model")
LORA_MEDIA_SPEC = attrs.evolve(TOY_MEDIA_SPEC, lora=TARGETS)
MLP = {k: v for k, v in TOY_LINEARS.items() if k.startswith("mlp")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-files")
    loras = root / "loras"
    f = {
        "a": write_peft(root / "preloaded" / "a_lora", MLP, rank=4, seed=1),
        "b": write_peft(root / "preloaded" / "b_lora", {"mlp.0": TOY_LINEARS["mlp.0"],
                                                        "time_proj": TOY_LINEARS["time_proj"]}, rank=8, seed=2),
        "dir": loras,
        "kohya": write_kohya(loras / "k.safetensors", {"mlp.1": TOY_LINEARS["mlp.1"]}, rank=2, seed=3),
        "sub": write_peft(loras / "sub" / "p", MLP, rank=4, seed=4),
        "no_module": write_peft(loras / "no_module", {"mlp.9": (64, 64)}, seed=5),
        "not_target": write_peft(loras / "not_target", {"modulation": (64, 32)}, seed=6),
        "bad_shape": write_peft(loras / "bad_shape", {"mlp.0": (32, 64)}, seed=7),
        "outside": write_peft(root / "outside" / "o", MLP, seed=8),
        "rank_mismatch": write_peft(loras / "rank_mismatch", MLP, rank=4, config_rank=8, seed=9),
        "unknown_key": write_peft(loras / "unknown_key", MLP, seed=10,
                                  extra={"base_model.model.mlp.0.lora_magnitude_vector": torch.ones(64)}),
        "big": write_peft(loras / "big", MLP, rank=16, seed=11),  # 16 KiB fp32: over a 9000-byte budget
        "png": write_png(root / "in.png", 90).read_bytes(),
    }
    (loras / "pickled.bin").write_bytes(b"\x80\x04not a safetensors file")
    return f


def _engine(root, files, *, spec=LORA_MEDIA_SPEC, max_device_bytes=None, max_host_bytes=None, **settings) -> Engine:
    s = Settings(cache_dir=str(root / "cache"), **settings)
    registry = AdapterRegistry(modules={"a": str(files["a"]), "b": str(files["b"])}, lora_dirs=[str(files["dir"])],
                               max_device_bytes=max_device_bytes, max_host_bytes=max_host_bytes)
    return Engine(f"tiny:{spec.name}", host=toy_host(s, plugin=ToyPlugin(spec)), settings=s, lora_registry=registry)


def _serve(engine: Engine, state) -> LiveServer:
    from omnicore.server import ServerSettings, create_app

    return LiveServer(create_app(engine, ServerSettings(state_dir=state))).start()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("lora-server")
    server = _serve(_engine(root, files), root / "state")
    yield server
    server.stop()


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _image(c: httpx.Client, **body) -> np.ndarray:
    r = c.post("/v1/images/generations", json={"prompt": "a lamp", "seed": 3, **body})
    assert r.status_code == 200, r.text
    return _png(r.json()["data"][0]["b64_json"])


def _python(srv: LiveServer, loras=(), **kw) -> np.ndarray:
    [out] = srv.ctx.engine.generate("a lamp", seed=3, loras=loras, **kw)
    return np.asarray(out.frames)[0]


def test_images_apply_adapters_exactly_as_the_python_api(srv, client_for):
    c = client_for(srv)
    plain = _image(c)
    assert np.array_equal(plain, _python(srv))
    cases = [([{"name": "a"}], [LoRA("a")]),
             ([{"path": "k.safetensors", "scale": 0.7}], [LoRA("k.safetensors", 0.7)]),
             ([{"name": "a"}, {"name": "b", "scale": 0.5}, {"path": "sub/p", "scale": -1}],
              [LoRA("a"), LoRA("b", 0.5), LoRA("sub/p", -1.0)])]
    for body, loras in cases:
        got = _image(c, lora=body)
        assert np.array_equal(got, _python(srv, loras)), body
        assert not np.array_equal(got, plain), body  # the adapter changes the noise
    assert np.array_equal(_image(c, lora=[{"name": "a", "scale": 0}]), plain)  # scale 0 is no adapter, exactly
    assert np.array_equal(_image(c, lora={"name": "a"}), _python(srv, [LoRA("a")]))  # one object: a list of one


def test_openai_sdk_extra_body_on_generations_and_edits(srv, client_for, files):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    body = [{"name": "b", "scale": 0.5}]
    img = client.images.generate(model="toy-media", prompt="a lamp", extra_body={"seed": 3, "lora": body})
    assert np.array_equal(_png(img.data[0].b64_json), _python(srv, [LoRA("b", 0.5)]))
    # edits are multipart: the SDK flattens the list to lora[][name]=a, lora[][path]=sub/p, lora[][scale]=0.5
    adapters = [{"name": "a"}, {"path": "sub/p", "scale": 0.5}]
    edited = client.images.edit(model="toy-media", prompt="a lamp", image=("in.png", files["png"], "image/png"),
                                extra_body={"seed": 4, "lora": adapters})
    c = client_for(srv)
    as_json_text = c.post("/v1/images/edits", data={"prompt": "a lamp", "seed": "4", "lora": json.dumps(adapters)},
                          files={"image": ("in.png", files["png"], "image/png")})
    without = c.post("/v1/images/edits", data={"prompt": "a lamp", "seed": "4"},
                     files={"image": ("in.png", files["png"], "image/png")})
    assert as_json_text.status_code == without.status_code == 200, (as_json_text.text, without.text)
    sdk = _png(edited.data[0].b64_json)
    assert np.array_equal(sdk, _png(as_json_text.json()["data"][0]["b64_json"]))
    assert not np.array_equal(sdk, _png(without.json()["data"][0]["b64_json"]))


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _video(c: httpx.Client, vid: str) -> np.ndarray:
    for _ in range(600):
        job = c.get(f"/v1/videos/{vid}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.05)
    assert job["status"] == "completed", job
    return _frames(c.get(f"/v1/videos/{vid}/content").content)


def test_videos_take_lora_as_json_and_through_the_sdk(srv, client_for):
    openai = pytest.importorskip("openai")
    c = client_for(srv)
    base = {"prompt": "a lamp", "num_frames": 2, "seed": 6}
    plain = c.post("/v1/videos", json=base).json()["id"]
    with_json = c.post("/v1/videos", json={**base, "lora": [{"name": "a", "scale": 0.8}]}).json()["id"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks the Sora API deprecated
        sdk = client.videos.create(prompt="a lamp", extra_body={"num_frames": 2, "seed": 6,
                                                                "lora": [{"name": "a", "scale": 0.8}]}).id
    frames = {k: _video(c, v) for k, v in (("plain", plain), ("json", with_json), ("sdk", sdk))}
    assert np.array_equal(frames["json"], frames["sdk"])
    assert not np.array_equal(frames["json"], frames["plain"])


# ---------------------------------------------------------------------------------------------- refusals
REFUSED = [
    # schema: the field named, nothing resolved
    ([{"name": "a", "path": "sub/p"}], "lora.0", "invalid_value", "exactly one of name"),
    ([{"scale": 1}], "lora.0", "invalid_value", "exactly one of name"),
    ([{"name": "a", "scale": 1e9}], "lora.0.scale", "invalid_value", "less than or equal"),
    ([{"name": "a", "scale": True}], "lora.0.scale", "invalid_value", "not a boolean"),
    ([{"name": ""}], "lora.0.name", "invalid_value", "at least 1"),
    ([{"name": "a", "weight": 1}], "lora.0.weight", "unknown_parameter", "unknown parameter"),
    ([{"name": "a"}] * 9, "lora", "invalid_value", "at most 8"),
    ("a", "lora", "invalid_value", "valid list"),
    # the registry and the model: the adapter (and key) named
    ([{"name": "nope"}], "lora", "invalid_lora", "'nope'"),
    ([{"path": "../outside/o"}], "lora", "invalid_lora", "outside the allowed LoRA directories"),
    ([{"path": "missing"}], "lora", "invalid_lora", "no such adapter"),
    ([{"path": "pickled.bin"}], "lora", "invalid_lora", "safetensors"),
    ([{"path": "no_module"}], "lora", "invalid_lora", "mlp.9"),
    ([{"path": "not_target"}], "lora", "invalid_lora", "modulation"),
    ([{"path": "bad_shape"}], "lora", "invalid_lora", "mlp.0"),
    ([{"path": "rank_mismatch"}], "lora", "invalid_lora", "rank mismatch for 'mlp.0': the config says r=8"),
    ([{"path": "unknown_key"}], "lora", "invalid_lora", "'base_model.model.mlp.0.lora_magnitude_vector': unknown key"),
    ([{"name": "a"}, {"path": "no_module"}], "lora", "invalid_lora", "'no_module'"),
]


@pytest.mark.parametrize(("lora", "param", "code", "text"), REFUSED, ids=[r[3] + f"-{i}" for i, r in
                                                                          enumerate(REFUSED)])
def test_every_refusal_is_a_400_before_anything_is_queued(srv, client_for, files, lora, param, code, text):
    c = client_for(srv)
    engine = srv.ctx.engine
    before = (dict(engine.pipeline.preprocess_calls), engine.stats()["steps_executed"],
              len(c.get("/v1/videos").json()["data"]))
    for route, body in (("/v1/images/generations", {"prompt": "x", "lora": lora}),
                        ("/v1/videos", {"prompt": "x", "num_frames": 2, "lora": lora})):
        r = c.post(route, json=body)
        assert r.status_code == 400, (route, lora, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, code), (route, err)
        assert text in err["message"], err["message"]
    after = (dict(engine.pipeline.preprocess_calls), engine.stats()["steps_executed"],
             len(c.get("/v1/videos").json()["data"]))
    assert after == before  # no preprocess, no step, no video job recorded


def test_a_model_without_lora_targets_refuses_adapters(make_server, client_for):
    c = client_for(make_server())
    r = c.post("/v1/images/generations", json={"prompt": "x", "lora": [{"name": "a"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora", r.text
    assert "does not support LoRA" in r.json()["error"]["message"]
    assert c.get("/v1/models").json()["data"][0]["omnicore"]["loras"] == []


# ---------------------------------------------------------------------------------------------- listing, metrics
def test_models_lists_the_preloaded_adapters_of_their_base_model(srv, client_for):
    card = client_for(srv).get("/v1/models").json()["data"][0]
    assert card["id"] == "toy-media"
    loras = {x["name"]: x for x in card["omnicore"]["loras"]}
    assert list(loras) == ["a", "b"]  # the preloaded ones; paths under --lora-dir are not listed
    assert (loras["a"]["layout"], loras["a"]["rank"], loras["a"]["modules"]) == ("peft", 4, 2)
    assert (loras["b"]["rank"], loras["b"]["base_model"]) == (8, "tiny:toy")
    assert all("path" not in x for x in loras.values())  # server paths stay private


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{name}\{{model="([^"]+)"\}} (\S+)$', text, re.M)
    assert m is not None, f"{name} missing:\n{text}"
    return float(m.group(2))


def test_metrics_expose_the_registry_counters_and_bytes(srv, client_for):
    c = client_for(srv)
    _image(c, lora=[{"name": "b"}])
    first = c.get("/metrics").text
    _image(c, lora=[{"name": "b"}])
    second = c.get("/metrics").text
    assert _metric(second, "omnicore_lora_loads_total") == _metric(first, "omnicore_lora_loads_total")  # cached
    assert _metric(second, "omnicore_lora_hits_total") > _metric(first, "omnicore_lora_hits_total")
    stats = srv.ctx.engine.lora_registry.stats()
    assert _metric(second, "omnicore_lora_device_bytes") == stats["device_bytes"] > 0
    assert _metric(second, "omnicore_lora_host_bytes") == stats["host_bytes"] > 0
    assert _metric(second, "omnicore_lora_evictions_total") == stats["evictions"]


def test_a_device_budget_evicts_and_reloads_from_host_memory(tmp_path, files, client_for):
    # a: 2 modules x (4x64 + 64x4) fp32 = 4 KiB, b: 8 KiB; 9000 bytes hold one of them at a time
    server = _serve(_engine(tmp_path, files, max_device_bytes=9000), tmp_path / "state")
    try:
        c = client_for(server)
        for name in ("a", "b", "a", "a"):
            _image(c, lora=[{"name": name}])
        text = c.get("/metrics").text
        assert _metric(text, "omnicore_lora_evictions_total") >= 2  # a out for b, b out for a
        assert _metric(text, "omnicore_lora_uploads_total") == 3  # the hot a on the last request: no copy
        assert _metric(text, "omnicore_lora_loads_total") == 2  # each file read once, evicted copies from host
        assert _metric(text, "omnicore_lora_device_bytes") <= 9000
        assert _metric(text, "omnicore_lora_batch_bytes") == 0  # no batch running: its slots are released
        # an adapter larger than the budget: a 400 naming it, before anything is queued
        steps = server.ctx.engine.stats()["steps_executed"]
        r = c.post("/v1/images/generations", json={"prompt": "x", "lora": [{"path": "big"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora", r.text
        assert "'big'" in r.json()["error"]["message"] and "more than the LoRA cache budget (9000 bytes)" in r.text
        assert server.ctx.engine.stats()["steps_executed"] == steps
    finally:
        server.stop()


def test_a_host_budget_drops_and_rereads_adapters(tmp_path, files, client_for):
    """Host memory is bounded too: with 9000 bytes for converted adapters (a: 4 KiB, b: 8 KiB) one of them stays;
    naming the other reads its file again (loads), the dropped copies are counted, and the outputs are unchanged."""
    server = _serve(_engine(tmp_path, files, max_host_bytes=9000), tmp_path / "state")
    try:
        c = client_for(server)
        first = _image(c, lora=[{"name": "a"}])
        _image(c, lora=[{"name": "b"}])
        again = _image(c, lora=[{"name": "a"}])
        text = c.get("/metrics").text
        assert _metric(text, "omnicore_lora_host_bytes") <= 9000
        assert _metric(text, "omnicore_lora_host_evictions_total") >= 2  # (start-up read both: a went, then b)
        assert _metric(text, "omnicore_lora_loads_total") >= 4  # a, b at start-up, then a and b and a again
        assert np.array_equal(first, again)
    finally:
        server.stop()


def test_requests_with_different_adapters_share_a_batch_and_each_equals_its_solo_run(tmp_path, files, client_for):
    server = _serve(_engine(tmp_path, files, max_num_seqs=4, request_batch_max_wait_ms=1500), tmp_path / "state")
    try:
        bodies = [[{"name": "a"}], [{"name": "b", "scale": 0.5}], [], [{"path": "k.safetensors"}]]
        got: dict[int, np.ndarray] = {}

        def post(i: int) -> None:
            got[i] = _image(client_for(server), lora=bodies[i])

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = server.ctx.engine.stats()
        assert stats["last_batch_size"] == 4 and stats["batches_executed"] == 1, stats  # one mixed batch
        solo = [[LoRA("a")], [LoRA("b", 0.5)], [], [LoRA("k.safetensors")]]
        for i, loras in enumerate(solo):
            assert np.array_equal(got[i], _python(server, loras)), i
    finally:
        server.stop()


def test_compile_refuses_adapters_on_every_surface(tmp_path, files, client_for, monkeypatch):
    """``--compile`` with adapters: an engine given LoRA settings is refused before it loads (Python ``Engine``;
    the CLI's ``generate`` / ``serve`` in test_cli_lora), and a compiled engine refuses a request's adapters
    before it is queued — a LoRAError from ``submit`` and a 400 ``invalid_lora`` over HTTP, both naming --compile."""
    from omnicore.engine.api import make_request
    from omnicore.errors import UnsupportedFeature
    from omnicore.lora import LoRAError
    from toy.pipeline import ToyPipeline

    monkeypatch.setattr(ToyPipeline, "compile_regions", ("model.mlp",), raising=False)  # blocks to compile
    s = Settings(cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UnsupportedFeature, match="compile: --compile blocks cannot be combined with LoRA adapters"):
        Engine("tiny:toy-media", host=toy_host(s, plugin=ToyPlugin(LORA_MEDIA_SPEC)), settings=s, compile="blocks",
               lora_registry=AdapterRegistry(lora_dirs=[str(files["dir"])]))
    engine = Engine("tiny:toy-media", host=toy_host(s, plugin=ToyPlugin(LORA_MEDIA_SPEC)), settings=s,
                    compile="blocks")
    assert engine.compile_handle is not None  # compiled (lazily: nothing runs here)
    with pytest.raises(LoRAError, match="not supported with --compile"):
        engine.submit(make_request("x", loras=[LoRA("a")]))
    server = _serve(engine, tmp_path / "state")
    try:
        r = client_for(server).post("/v1/images/generations", json={"prompt": "x", "lora": [{"name": "a"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora", r.text
        assert "not supported with --compile" in r.json()["error"]["message"]
        assert engine.stats()["steps_executed"] == 0
    finally:
        server.stop()
