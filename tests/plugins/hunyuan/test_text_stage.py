"""HunyuanImage-3's text stage (think / recaption / the ratio token) on the micro checkpoint (random weights: the
text is noise, so these tests check the mechanics): cached decode against a full recompute, seeded sampling,
budget and stop tags, the splice into the image layout, K/V reuse against a full forward, the ratio choice, the
text on the output and over real HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import httpx
import pytest
import torch
from _hunyuan_helpers import load, request, run, square_image
from omni_hunyuan.text_stage import TextJob
from omnicore.errors import InvalidRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))  # _server_helpers


def _resolved(pipe, **extra):
    kw = {}
    if extra.pop("auto_size", False):
        kw = {"height": None, "width": None}
    return pipe.preprocess(request(extra=extra, **kw)).plan


def _prompt(pipe, resolved):
    """The text stage's prompt: the image layout up to the CoT slot, then the trigger tag."""
    base = pipe.tokenizer.layout(attrs.evolve(resolved.spec, cfg_factor=1))
    trigger = pipe.tokenizer.ids["recaption" if resolved.text.task == "recaption" else "think"]
    return list(base.tokens[0][:base.cot_slice[0]]) + [trigger]


def test_greedy_decode_equals_a_full_recompute_at_every_step(pipe):
    from omni_hunyuan.text_stage import reference_greedy

    res = _resolved(pipe, bot_task="think", max_new_tokens=10)
    assert res.text.task == "think" and res.text.temperature == 0.0
    (out,) = pipe.text_stage.run([TextJob(res.spec, res.text, 7)])
    ref = reference_greedy(pipe.model, _prompt(pipe, res), 10, pipe.text_stage.vocab_limit)
    got = list(out.token_ids)
    assert got == ref[:len(got)]
    assert len(got) == 10 or got[-1] in pipe.text_stage.stops("think")
    assert out.text == pipe.tokenizer.decode([pipe.tokenizer.ids["think"]] + got[:len(got)])
    (again,) = pipe.text_stage.run([TextJob(res.spec, res.text, 99)])  # greedy: the seed does not matter
    assert again.token_ids == out.token_ids


def test_sampling_is_seeded(pipe):
    res = _resolved(pipe, bot_task="recaption", max_new_tokens=12, temperature=1.0, top_k=64, top_p=0.95)
    a, b, c = pipe.text_stage.run([TextJob(res.spec, res.text, seed) for seed in (1, 1, 2)])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.metrics["text_batch"] == 3.0  # equally long prompts decode as one batch
    (alone,) = pipe.text_stage.run([TextJob(res.spec, res.text, 2)])
    assert alone.token_ids == c.token_ids  # batching does not change a request's tokens


def test_pick_token_filters():
    from omni_hunyuan.text_stage import pick_token

    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, float("-inf")])
    gen = torch.Generator().manual_seed(0)
    assert pick_token(logits, 0.0, 0, 1.0, None) == 1
    assert {pick_token(logits, 1.0, 1, 1.0, gen) for _ in range(20)} == {1}  # top-k 1
    assert {pick_token(logits, 1.0, 0, 0.01, gen) for _ in range(20)} == {1}  # nucleus keeps the top token
    assert {pick_token(logits, 1.0, 2, 1.0, gen) for _ in range(200)} == {1, 2}
    assert 4 not in {pick_token(logits, 5.0, 0, 1.0, gen) for _ in range(200)}


def _biased_stage(pipe, token: int, after: int):
    """The pipeline's stage whose logits favour ``token`` from the ``after``-th call on (drives the stop tag)."""
    from omni_hunyuan.text_stage import TextStage

    class Biased(TextStage):
        calls = 0

        def logits(self, hidden):
            out = super().logits(hidden)
            Biased.calls += 1
            if Biased.calls > after:
                out[:, token] += 1e4
            return out

    return Biased(pipe.model, pipe.tokenizer, pipe.device)


def test_the_stop_tag_and_the_budget_end_the_text(pipe):
    ids = pipe.tokenizer.ids
    res = _resolved(pipe, bot_task="think", max_new_tokens=30)
    (out,) = _biased_stage(pipe, ids["end_think"], 3).run([TextJob(res.spec, res.text, 7)])
    assert len(out.token_ids) == 4 and out.token_ids[-1] == ids["end_think"]
    assert out.text.startswith("<think>") and out.text.endswith("</think>")
    res = _resolved(pipe, bot_task="think", max_new_tokens=5)
    (out,) = _biased_stage(pipe, ids["img"], 0).run([TextJob(res.spec, res.text, 7)])  # no stop: the budget ends
    assert len(out.token_ids) == 5


def test_think_recaption_forces_recaption_and_splices_the_text_into_the_layout(pipe):
    ids = pipe.tokenizer.ids
    res = _resolved(pipe, bot_task="think_recaption", max_new_tokens=30)
    assert res.bot_task == "think" and res.text.task == "think_recaption"
    stage = _biased_stage(pipe, ids["end_think"], 2)
    (out,) = stage.run([TextJob(res.spec, res.text, 7)])
    toks = list(out.token_ids)
    assert toks[2] == ids["end_think"] and toks[3] == ids["recaption"]  # the transition is forced once
    assert ids["end_recaption"] not in toks and len(toks) == 30  # </think> again is not a stop here
    layout = out.layout
    a, b = layout.cot_slice
    assert list(layout.tokens[0][a:b]) == [ids["think"]] + toks  # no closing tag: everything generated
    uncond = layout.tokens[1][a:b]
    # the closed think section keeps its tags in the CFG row; the unclosed recaption is plain text, like user text
    assert uncond[0] == ids["think"] and uncond[3] == ids["end_think"]
    assert set(uncond[1:3]) == {ids["cfg"]} and set(uncond[4:]) == {ids["cfg"]}


def test_cot_ids_build_the_layout_user_text_builds(pipe):
    """The splice of generated ids equals the layout the same text supplied by the client gets."""
    tok = pipe.tokenizer
    text = "<think>a fox in snow</think><recaption>a red fox, snow, dusk</recaption>"
    res = _resolved(pipe)
    for drop in (False, True):
        spec = attrs.evolve(res.spec, drop_think=drop)
        from_text = tok.layout(attrs.evolve(spec, cot_text=text))
        from_ids = tok.layout(attrs.evolve(spec, cot_ids=tuple(tok.encode_text(text))))
        assert from_ids == from_text
    user = _resolved(pipe, bot_task="think", ar_generated_text=text)
    assert user.text is None  # a client-supplied CoT is used as given: nothing is generated


def test_image_mode_generates_nothing(pipe):
    res = _resolved(pipe, bot_task="image")
    assert res.text is None
    state, (out,) = run(pipe, request(extra={"bot_task": "image"}, num_inference_steps=1))
    assert out.text is None and "text_tokens" not in out.metrics
    assert state.extras["items"][0]["layout"].cot_slice[0] == state.extras["items"][0]["layout"].cot_slice[1]


@pytest.mark.slow
def test_reused_text_kv_equals_a_full_recompute_and_the_text_is_returned(pipe):
    from omni_hunyuan.sampler import guide

    req = pipe.preprocess(request(extra={"bot_task": "think_recaption", "max_new_tokens": 8},
                                  num_inference_steps=2))
    state = pipe.encode([req])
    item = state.extras["items"][0]
    layout = item["layout"]
    assert layout.cot_slice[1] - layout.cot_slice[0] == 9  # <think> + 8 tokens
    assert item["past"].length == layout.prefix_len  # step 0 starts at the image's <timestep>
    assert item["text_metrics"]["text_reused_tokens"] == layout.cot_slice[1] - 1  # all but the last token seen
    pred = pipe.predict(state, 0)
    lat = state.latents[:1].expand(2, -1, -1, -1)
    t = torch.full((2,), float(state.timesteps[0]))
    full = pipe.model.full_forward(layout, item["tokens"], lat, t)
    ref = guide(full[:1], full[1:], 4.0, 0.0)
    assert torch.allclose(pred, ref, atol=1e-5, rtol=0), (pred - ref).abs().max()
    state = pipe.update(state, 0, pred)
    state = pipe.denoise_step(state, 1)
    (out,) = pipe.decode(state)
    assert out.text == item["text"] and out.text.startswith("<think>")
    assert out.metrics["text_tokens"] == 8.0 and out.metrics["text_tokens_per_s"] > 0


@pytest.mark.slow
def test_img_ratio_picks_the_bucket_from_the_ratio_token(pipe):
    from omni_hunyuan.transformer.rope import rope_table

    res = _resolved(pipe, bot_task="img_ratio", auto_size=True)
    assert res.text.task is None and res.text.ratio
    (out,) = pipe.text_stage.run([TextJob(res.spec, res.text, 7)])
    (ratio_id,) = out.token_ids
    index = pipe.tokenizer.ratio_ids.index(ratio_id)
    bucket = pipe.tokenizer.buckets.buckets[index]
    assert out.layout.ratio_index == index and (out.layout.gen_h * 16, out.layout.gen_w * 16) == (bucket.height,
                                                                                                   bucket.width)
    # independent: a full forward of the prompt, argmax over the usable ratio tokens
    base = pipe.tokenizer.layout(attrs.evolve(res.spec, cfg_factor=1))
    prompt = list(base.tokens[0][:base.gen_timestep - 1])
    assert prompt[-1] == pipe.tokenizer.size_id
    pos = torch.arange(len(prompt))
    cos, sin = rope_table(torch.stack([pos, pos], 1), pipe.config.attention_head_dim, pipe.config.rope_theta)
    m = pipe.model
    hidden, _ = m.run_layers(m.model.wte(torch.tensor([prompt])), cos, sin, (), None, 0)
    logits = m.lm_head(m.model.ln_f(hidden[:, -1]))[0]
    cands = pipe.text_stage.ratio_candidates()
    assert ratio_id == cands[int(torch.argmax(logits[cands]))]
    assert pipe.batch_key(pipe.preprocess(request(extra={"image_size": "auto"}, height=None, width=None))) != \
        pipe.batch_key(pipe.preprocess(request(extra={"image_size": "auto"}, height=None, width=None)))
    _, (img,) = run(pipe, request(extra={"bot_task": "img_ratio"}, height=None, width=None, num_inference_steps=1))
    assert (img.height, img.width) == (bucket.height, bucket.width) and img.text is None


@pytest.mark.slow
def test_the_paged_pool_serves_a_repeated_prompt_to_the_text_stage(paged_pipe):
    """With the paged prefix pool, the image prefixes the text stage built are published; a repeated request finds
    its prompt blocks resident and prefills only the rest, with the same tokens and the same first step."""
    pipe = paged_pipe
    pipe.pool.clear()
    preds, texts = [], []
    for _ in range(2):
        req = pipe.preprocess(request("a tall lighthouse on a rocky cliff at dusk",
                                      extra={"bot_task": "recaption", "max_new_tokens": 5}, num_inference_steps=1))
        state = pipe.encode([req])
        item = state.extras["items"][0]
        texts.append((item["text"], item["text_metrics"]["text_pool_hit_tokens"]))
        preds.append(pipe.predict(state, 0))
    prompt_len = item["layout"].cot_slice[0] + 1
    assert texts[0][1] == 0 and texts[1][1] == (prompt_len - 1) // 8 * 8 > 0
    assert texts[0][0] == texts[1][0]
    assert torch.allclose(preds[0], preds[1], atol=1e-5, rtol=0)
    assert pipe.pool.stats.published > 0


@pytest.mark.slow
def test_drop_think_keeps_only_the_recaption_and_the_image_prefix_stays_exact(pipe):
    """With drop_think the image prompt holds only ``<recaption>…</recaption>`` (and the recaption system prompt
    replaces the system prompt): the text stage's K/V is reused only up to where the sequences differ, the rest is
    prefilled, and the first step still equals a full forward; the returned text keeps the thinking."""
    from omni_hunyuan.request_rules import SYSTEM_PROMPTS
    from omni_hunyuan.sampler import guide
    from omni_hunyuan.text_stage import TextStage

    ids = pipe.tokenizer.ids

    class Scripted(TextStage):
        calls = 0

        def logits(self, hidden):
            out = super().logits(hidden)
            Scripted.calls += 1
            forced = {3: ids["end_think"], 7: ids["end_recaption"]}.get(Scripted.calls)
            if forced is not None:
                out[:, forced] += 1e4
            return out

    saved = pipe._text_stage
    pipe._text_stage = Scripted(pipe.model, pipe.tokenizer, pipe.device)
    try:
        req = pipe.preprocess(request(extra={"bot_task": "think_recaption", "max_new_tokens": 20, "drop_think": True,
                                             "use_system_prompt": "en_unified"}, num_inference_steps=1))
        state = pipe.encode([req])
    finally:
        pipe._text_stage = saved
    item = state.extras["items"][0]
    layout = item["layout"]
    a, b = layout.cot_slice
    cot = list(layout.tokens[0][a:b])
    assert cot[0] == ids["recaption"] and cot[-1] == ids["end_recaption"] and ids["think"] not in cot
    assert item["text"].startswith("<think>") and "</think><recaption>" in item["text"]
    assert item["text"].endswith("</recaption>")
    system = pipe.tokenizer.encode_text(SYSTEM_PROMPTS["en_recaption"])
    assert list(layout.tokens[0][1:1 + len(system)]) == system
    assert 0 < item["text_metrics"]["text_reused_tokens"] < a
    pred = pipe.predict(state, 0)
    lat = state.latents[:1].expand(2, -1, -1, -1)
    full = pipe.model.full_forward(layout, item["tokens"], lat, torch.full((2,), float(state.timesteps[0])))
    assert torch.allclose(pred, guide(full[:1], full[1:], 4.0, 0.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"extra": {"bot_task": "think", "max_new_tokens": 4096}}, "extra.max_new_tokens"),
    ({"extra": {"bot_task": "think", "max_new_tokens": 0}}, "extra.max_new_tokens"),
    ({"extra": {"bot_task": "think", "temperature": -1}}, "extra.temperature"),
    ({"extra": {"bot_task": "think", "top_p": 0}}, "extra.top_p"),
    ({"extra": {"bot_task": "think", "top_k": 1.5}}, "extra.top_k"),
    ({"extra": {"image_size": "512x512"}}, "extra.image_size"),
    ({"extra": {"image_size": "auto"}}, "params.height"),  # the helper sets 64x64 explicitly
])
def test_bad_text_stage_inputs_name_the_field(pipe, kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(**kwargs))
    assert info.value.field == field


@pytest.mark.slow
def test_an_edit_thinks_over_its_condition_image_and_reuses_the_kv(pipe):
    """The prompt holds a condition image (VAE + ViT tokens in a bidirectional span): the text stage embeds it as
    the image stage does, and the step-0 prediction from the reused K/V equals a full forward."""
    from omni_hunyuan.sampler import guide
    from omni_hunyuan.text_stage import TextStage

    req = pipe.preprocess(request("make it blue", images=(square_image(80),),
                                  extra={"bot_task": "think", "max_new_tokens": 6}, num_inference_steps=1))
    state = pipe.encode([req])
    item = state.extras["items"][0]
    layout = item["layout"]
    assert layout.cond and layout.cot_slice[1] - layout.cot_slice[0] in range(2, 8)
    assert item["text_metrics"]["text_reused_tokens"] > layout.cond[-1].vit_end
    pred = pipe.predict(state, 0)
    lat = state.latents[:1].expand(2, -1, -1, -1)
    t = torch.full((2,), float(state.timesteps[0]))
    full = pipe.model.full_forward(layout, item["tokens"], lat, t, cond=item["cond"])
    assert torch.allclose(pred, guide(full[:1], full[1:], 4.0, 0.0), atol=1e-5, rtol=0)
    # the first generated token is the argmax of a full forward of the prompt (condition image included)
    res = req.plan
    base = pipe.tokenizer.layout(attrs.evolve(res.spec, cfg_factor=1))
    prompt = list(base.tokens[0][:base.cot_slice[0]]) + [pipe.tokenizer.ids["think"]]
    stage = TextStage(pipe.model, pipe.tokenizer, pipe.device)
    cos, sin = stage._rope(len(prompt), base)
    ids = torch.tensor([prompt])
    emb = stage._embed(base, ids, 0, len(prompt), item["cond"])
    m = pipe.model
    hidden, _ = m.run_layers(emb, cos, sin, base.joint_image_slices, None, 0)
    logits = stage.logits(hidden)[0]
    logits[stage.vocab_limit:] = float("-inf")
    assert layout.tokens[0][layout.cot_slice[0] + 1] == int(torch.argmax(logits))


@pytest.fixture(scope="module")
def server(micro_dir, tmp_path_factory):
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("hunyuan-text-http")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("hunyuan",))
    engine = Engine(str(micro_dir), host=PluginHost(settings), settings=settings)
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"), model_arg=str(micro_dir))).start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_revised_prompt_carries_the_generated_text_over_http(server):
    body = {"prompt": "a lighthouse at dusk", "num_inference_steps": 1, "seed": 3, "size": "64x64",
            "model_params": {"bot_task": "recaption", "max_new_tokens": 6}}
    resp = httpx.post(server.url + "/v1/images/generations", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    text = resp.json()["data"][0]["revised_prompt"]
    assert isinstance(text, str) and text.startswith("<recaption>")
    again = httpx.post(server.url + "/v1/images/generations", json=body, timeout=120).json()
    assert again["data"][0]["revised_prompt"] == text  # greedy: the same text
    body["model_params"]["max_new_tokens"] = 100000
    err = httpx.post(server.url + "/v1/images/generations", json=body, timeout=60)
    assert err.status_code == 400 and "max_new_tokens" in err.json()["error"]["param"], err.text


def test_a_cancel_stops_the_text_stage_within_one_token(pipe):
    """The stage checks cancellation between tokens (a runner's cancel scope makes the check live)."""
    from omni_hunyuan.text_stage import TextStage
    from omnicore.engine.cancellation import cancel_scope
    from omnicore.errors import Cancelled

    res = _resolved(pipe, bot_task="think", max_new_tokens=50)
    seen = []

    class Counting(TextStage):
        def logits(self, hidden):
            seen.append(hidden.shape[1])
            return super().logits(hidden)

    stage = Counting(pipe.model, pipe.tokenizer, pipe.device)
    with cancel_scope(lambda: len(seen) >= 3), pytest.raises(Cancelled):
        stage.run([TextJob(res.spec, res.text, 7)])
    assert len(seen) == 3  # the prefill and two tokens: no forward after the request asked to stop


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp=2", "cfg=2"])
def test_the_text_stage_runs_on_the_parallel_ranks(micro_dir, parallel):
    """Under --parallel (gloo, 2 processes) the ranks decode the same text (TP: each rank holds its share of the
    key/value heads in the text stage's cache; CFG: each rank keeps its row of the reused prefix) and the image
    equals the single-process engine's."""
    import numpy as np
    from omnicore.engine.api import Engine, make_request
    from omnicore.plugin_host.host import default_host

    settings = default_host().settings
    params = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 5,
              "extra": {"bot_task": "think_recaption", "max_new_tokens": 6}}
    outs = []
    for par in (None, parallel):
        with Engine(str(micro_dir), settings=settings, parallel=par) as engine:
            outs.append(engine.submit(make_request("a red fox in the snow", **params)).result(600)[0])
    single, multi = outs
    assert single.text is not None and multi.text == single.text
    assert np.abs(single.frames.astype(int) - multi.frames.astype(int)).max() <= 1


def test_re_prefilling_after_the_text_stage_equals_reusing_its_kv(pipe):
    """``reuse_text_kv = False`` (the benchmark's re-prefill arm) recomputes the prefix at the first step: the same
    latents as starting from the text stage's K/V."""
    req = request(extra={"bot_task": "think", "max_new_tokens": 6}, num_inference_steps=2)
    reused, _ = run(pipe, req, decode=False)
    pipe.reuse_text_kv = False
    try:
        again, _ = run(pipe, req, decode=False)
    finally:
        pipe.reuse_text_kv = True
    assert reused.extras["items"][0]["text"] == again.extras["items"][0]["text"]
    assert torch.allclose(reused.latents, again.latents, atol=1e-5, rtol=0)


def test_the_server_sets_the_budget_cap_as_a_model_option(micro_dir):
    """``--model-option text_max_new_tokens=N`` is the cap: a declared option (checked at load like every other),
    and a request's budget above it is refused naming the field and the cap."""
    from omni_hunyuan.plugin import MODEL_SPEC
    from omnicore.engine.model_options import resolve_model_options

    options = resolve_model_options(MODEL_SPEC, {"text_max_new_tokens": "8"})
    capped = load(micro_dir, text_max_new_tokens=options["text_max_new_tokens"])
    assert capped.preprocess(request(extra={"bot_task": "think", "max_new_tokens": 8})) is not None
    with pytest.raises(InvalidRequest) as info:
        capped.preprocess(request(extra={"bot_task": "think", "max_new_tokens": 9}))
    assert info.value.field == "extra.max_new_tokens" and "cap 8" in str(info.value)
