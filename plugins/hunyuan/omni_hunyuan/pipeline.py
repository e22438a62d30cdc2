"""``HunyuanImage3Pipeline``: the omnicore pipeline protocol for HunyuanImage-3.

``preprocess`` (once, at admission, outside engine locks) resolves the request (mode, bucket, steps, guidance,
``bot_task``, CoT, system prompt), loads condition images and — in the ``paged_scheduler`` KV mode — tokenises
and attaches the :class:`~omni_hunyuan.transformer.layout.PreparedLayout` (layout, one KV request per CFG row, block
hashes). ``encode`` builds per request the layout (taken from the prepared one, or tokenised here in
``dense_legacy``), the RoPE table and the initial latents (a CPU generator seeded with the request's seed).
``predict`` runs the model per request over its CFG rows ``[cond, uncond]``: step 0 from position 0 (or from
the pooled prefix blocks on a pool hit), keeping the prefix K/V; later steps only ``[<timestep>, <img>*N]``.
``update`` takes an Euler step; ``decode`` runs the VAE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.plugin import (
    BasePipeline,
    ConfigError,
    DenoiseState,
    GenerationRequest,
    InvalidRequest,
    LoadOptions,
    Output,
    UnsupportedFeature,
    check_extra,
    fast_path_gate,
    lora_base_only,
    lora_sample_rows,
    output_seeds,
    parallel_vae_decode_enabled,
    random_seed,
    report_stage_progress,
)

from .conditions import image_digest, load_image, make_vit_processor, vae_pixels, vit_inputs
from .kv_pool import PrefixKVPool, block_hashes, row_identity
from .loader import PLUGIN, CheckpointError, load_state
from .plugin import MODEL_SPEC
from .request_rules import (
    PROMPT_FIELDS,
    check_prompt_mapping,
    normalize_bot_task,
    normalize_cot,
    parse_kv_mode,
    resolve_guidance,
    resolve_system_prompt,
    snap_size,
    text_sampling,
    text_task,
    wants_ratio,
)
from .sampler import GRIDS, euler_step, guide, initial_noise, model_timesteps, sigmas
from .text_stage import TextJob, TextPlan, TextStage
from .tokenizer import CondImageInfo, HunyuanTokenizer, LayoutSpec
from .transformer.config import ConfigFileError, GenerationConfig, HunyuanConfig
from .transformer.layout import PreparedLayout, SequenceLayout, kv_requests
from .transformer.model import CondFeatures, HunyuanImage3, PrefixKV, build_sharded
from .vae import install_fast_paths as install_vae_fast_paths
from .vae_tiling import VaeTiles, tiled_decode

MODES = ("t2i", "edit")
__all__ = ["PROMPT_FIELDS", "HunyuanImage3Pipeline", "Resolved"]


def _text_defaults(path: Path) -> dict[str, Any]:
    """The text stage's sampling keys of ``generation_config.json`` (absent keys: greedy, the server's cap)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    keys = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens")
    return {k: data[k] for k in keys if k in data and data[k] is not None}


def _adapted(request: GenerationRequest) -> bool:
    """Whether a LoRA adapter changes this request (scale 0 is exactly no adapter)."""
    return any(lora.scale != 0.0 for lora in request.loras)


@attrs.frozen
class Resolved:
    """What preprocess decided for one request: the request's typed ``plan`` (``GenerationRequest.plan``), read
    back with ``request.plan_as(Resolved)``; the caller's ``extra`` is left as sent."""

    mode: str
    spec: LayoutSpec
    guidance: float
    cfg_factor: int
    guidance_rescale: float
    bot_task: str | None
    images: tuple[Any, ...] = ()  # PIL images (edits)
    identity: str = ""  # prefix identity beyond the tokens (edits: reference content, grids, VAE seed)
    text: TextPlan | None = None  # the text stage (think / recaption / the ratio token), None: none
    prepared_layout: PreparedLayout | None = None  # paged_scheduler mode: the tokens and the rows' KV requests


class HunyuanImage3Pipeline(BasePipeline):
    """Loads a HunyuanImage-3 repository and generates images (T2I) or edits them."""

    spec = MODEL_SPEC

    def __init__(self, model: HunyuanImage3, tokenizer: HunyuanTokenizer, gen_config: GenerationConfig, *,
                 device: torch.device, dtype: torch.dtype, path: Path | None = None, kv_mode: str = "dense_legacy",
                 kv_block_size: int = 16, kv_pool_blocks: int = 512, kv_reuse: bool = True,
                 vae_decode_precision: str | None = None, sampler_grid: str = "release",
                 text_defaults: Mapping[str, Any] | None = None, text_max_new_tokens: int = 2048) -> None:
        self.model = model
        self.config: HunyuanConfig = model.config
        self.tokenizer = tokenizer
        self.gen_config = gen_config
        self.device, self.dtype, self.path = device, dtype, path
        self.kv_mode = kv_mode
        self.kv_reuse = kv_reuse
        if sampler_grid not in GRIDS:
            raise ConfigError("sampler_grid", f"must be one of {', '.join(GRIDS)}, got {sampler_grid!r}")
        #: the timestep grid: the release's (default) or diffusers' FlowMatchEulerDiscreteScheduler's (sampler.py)
        self.sampler_grid = sampler_grid
        self.pool = PrefixKVPool(kv_block_size, kv_pool_blocks) if kv_mode == "paged_scheduler" else None
        self._vit_processor: Any = None
        #: None/"fp32": decode in float32; "fp16"/"bf16": under autocast to that dtype (the release decodes
        #: under fp16 autocast on GPUs)
        self.vae_decode_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(vae_decode_precision or "fp32")
        #: the text stage's sampling defaults (generation_config.json: do_sample, temperature, top_k, top_p,
        #: max_new_tokens) and the cap on a request's budget (model option text_max_new_tokens)
        self.text_defaults = dict(text_defaults or {})
        if isinstance(text_max_new_tokens, bool) or not isinstance(text_max_new_tokens, int) or text_max_new_tokens < 1:
            raise ConfigError("text_max_new_tokens", f"must be a positive integer, got {text_max_new_tokens!r}")
        self.text_max_new_tokens = text_max_new_tokens
        self._text_stage: TextStage | None = None
        #: the image stage starts from the K/V the text stage computed (False: it prefills the whole sequence
        #: again — the same result; benchmarks/hunyuan_ar.py measures what the reuse saves)
        self.reuse_text_kv = True

    # ------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: Path | str, options: LoadOptions) -> HunyuanImage3Pipeline:
        root = Path(path)
        opts = dict(getattr(options, "model_options", None) or {})
        kv_mode = parse_kv_mode(opts.get("kv_mode"))
        try:
            config = HunyuanConfig.from_file(root / "config.json")
            gen_config = GenerationConfig.from_file(root / "generation_config.json")
        except ConfigFileError as exc:
            raise CheckpointError(PLUGIN, root, str(exc)) from exc
        device, dtype = options.device(), options.torch_dtype()
        try:
            backend = options.select_attention(dtype, config.attention_head_dim, spans=True)
        except UnsupportedFeature:  # no backend serves spans here: the model's own mask-free attention
            backend = None
        parallel = options.parallel
        tp = (parallel.tp_rank, parallel.tp) if parallel is not None and parallel.tp > 1 else None
        ep = (parallel.ep_rank, parallel.ep) if parallel is not None and parallel.ep > 1 else None
        # built on the meta device with this rank's shapes (--parallel tp / ep: it reads and keeps its shard only),
        # then given storage in the load dtype: the host never holds random weights or a float32 copy of a bf16 load
        model = build_sharded(config, backend, tp, ep, dtype=dtype)
        load_state(model, root, tp=tp, ep=ep)
        model.to(device=device, dtype=dtype).eval()
        model.vae.float()
        if parallel is not None and parallel.tp > 1:
            model.enable_tensor_parallel(parallel)
        if parallel is not None and parallel.ep > 1:  # --parallel ep=N: this rank keeps 1/N of the routed experts
            model.enable_expert_parallel(parallel, str(opts.get("ep_dispatch") or "all_to_all"))
        install_vae_fast_paths(model.vae, options.platform.ops)  # run only for quality="high" requests
        tokenizer = HunyuanTokenizer.from_dir(root, config.image_base_size)
        pipeline = cls(model, tokenizer, gen_config, device=device, dtype=dtype, path=root, kv_mode=kv_mode,
                   kv_block_size=int(opts.get("kv_block_size") or 16),
                   kv_pool_blocks=int(opts.get("kv_pool_blocks") or 512),
                   kv_reuse=bool(opts.get("kv_reuse", True)),
                   sampler_grid=str(opts.get("sampler_grid") or "release"),
                   text_defaults=_text_defaults(root / "generation_config.json"),
                   text_max_new_tokens=int(opts.get("text_max_new_tokens") or 2048),
                   vae_decode_precision=getattr(options, "vae_decode_precision", None))
        pipeline.parallel = parallel
        pipeline.vae_tiles = VaeTiles.from_options(opts)
        pipeline.decode_on_every_rank = (pipeline.vae_tiles is not None
                                         and parallel_vae_decode_enabled(parallel, options.model_options))
        return pipeline

    #: this rank's omnicore.parallel.ParallelContext under ``--parallel`` (None in a single-process engine)
    parallel: Any = None
    #: ``vae_tile_size`` / ``vae_tile_overlap``: decode in overlapping tiles (None: untiled, the release's way)
    vae_tiles: VaeTiles | None = None
    #: under ``--parallel`` with a tiled decode (unless ``parallel_vae_decode=false``): every rank runs
    #: :meth:`decode`, decoding its round-robin share of each image's VAE tiles; rank 0 blends them
    decode_on_every_rank: bool = False

    def _cfg_row(self, rows: int) -> int | None:
        """Under ``--parallel cfg=2``: the CFG row (0 conditional, 1 unconditional) this rank computes of a guided
        item; ``None`` when it computes every row (no CFG ranks, or an unguided item)."""
        par = self.parallel
        return par.cfg_rank if par is not None and par.cfg > 1 and rows == 2 else None

    # ------------------------------------------------------------------------------------------ admission
    def fast_path_gates(self) -> list[Any]:
        """The VAE's request gate: the engine turns it on around ``quality="high"`` batches only."""
        return [fast_path_gate(self.model.vae)]

    #: The decoder layers ``--compile`` compiles one by one (one graph family for every layer; the span attention
    #: runs outside the graphs).
    compile_regions = ("model.model.layers",)

    @property
    def vit_processor(self) -> Any:
        if self._vit_processor is None:
            self._vit_processor = make_vit_processor(self.config.vit_processor)
        return self._vit_processor

    def resolve(self, request: GenerationRequest) -> tuple[Resolved, dict[str, Any]]:
        """The request's mode, layout spec and sampling values (no model work)."""
        check_extra(request.extra, self.spec)  # the spec's extra_fields (the engine checked them already)
        ex = dict(request.extra)
        prompt = request.prompt
        if isinstance(prompt, Mapping):
            # a prompt dict may carry the prompt fields; the request's extra wins over them
            text = prompt.get("prompt")
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequest("prompt.prompt", "a prompt mapping needs a non-empty 'prompt' string")
            check_prompt_mapping(prompt)
            for key in PROMPT_FIELDS:
                if key in prompt and key not in ex:
                    ex[key] = prompt[key]
            prompt = text
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", "must be a string (or a mapping with 'prompt') for HunyuanImage-3")
        if request.negative_prompt:
            raise InvalidRequest("negative_prompt", "is not supported: the unconditional row replaces the prompt "
                                                    "with <cfg> tokens; remove negative_prompt")
        if request.videos or request.audios:
            raise InvalidRequest("inputs", "HunyuanImage-3 takes only images")
        if request.params.num_outputs != 1:
            raise InvalidRequest("params.num_outputs", "HunyuanImage-3 makes one image per request")
        images = tuple(load_image(img, i) for i, img in enumerate(request.images))
        mode = ex.get("mode") or ("edit" if images else "t2i")
        if mode not in MODES:
            raise InvalidRequest("extra.mode", f"must be one of {list(MODES)}, got {mode!r}")
        if mode == "edit" and not images:
            raise InvalidRequest("inputs", "an image edit needs at least one input image (--image / image=...)")
        if mode == "t2i" and images:
            raise InvalidRequest("extra.mode", "t2i takes no input images; drop mode or the images")
        if images and not self.config.has_vision:
            raise UnsupportedFeature("edit", "this checkpoint has no vision tower (config.json lacks vit)")
        buckets = self.tokenizer.buckets
        p = request.params
        height, width = p.height, p.width
        explicit = height is not None or width is not None  # a size the client set is never changed silently
        if height is None or width is None:
            if images:
                default_h, default_w = images[0].height, images[0].width
            else:
                default_h = default_w = self.config.image_base_size
            height, width = height or default_h, width or default_w
        bucket = snap_size(height, width, buckets, self.config.vae_downsample_factor[0], explicit=explicit)
        guidance, cfg_factor = resolve_guidance(p.guidance_scale, self.config.cfg_distilled)
        rescale = ex.get("guidance_rescale", 0.0)
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or not 0.0 <= rescale <= 1.0:
            raise InvalidRequest("extra.guidance_rescale", f"must be a number in [0, 1], got {rescale!r}")
        bot_task = normalize_bot_task(ex.get("bot_task", self.gen_config.bot_task))
        template = ex.get("sequence_template", self.gen_config.sequence_template)
        if template not in ("pretrain", "instruct"):
            raise InvalidRequest("extra.sequence_template", f"must be 'pretrain' or 'instruct', got {template!r}")
        drop_think = ex.get("drop_think", self.gen_config.drop_think)
        if not isinstance(drop_think, bool):
            raise InvalidRequest("extra.drop_think", f"must be a boolean, got {drop_think!r}")
        seed = p.seed if p.seed is not None else random_seed(p.num_outputs)  # the engine normally filled it
        factor = self.config.vae_downsample_factor[0]
        cond: list[CondImageInfo] = []
        digests = []
        for img in images:
            cb = buckets.nearest(img.height, img.width)
            shapes = vit_inputs(self.vit_processor, img)["spatial_shapes"][0].tolist()
            cond.append(CondImageInfo(cb.index, cb.height // factor, cb.width // factor, int(shapes[0]),
                                      int(shapes[1])))
            digests.append(image_digest(img))
        spec = LayoutSpec(
            prompt=prompt, ratio_index=bucket.index, gen_h=bucket.height // factor,
            gen_w=bucket.width // factor, template=template,
            system_prompt=resolve_system_prompt(ex, self.gen_config.use_system_prompt),
            cot_text=normalize_cot(ex.get("ar_generated_text")), cond_images=tuple(cond), cfg_factor=cfg_factor,
            guidance_token=self.config.cfg_distilled, timestep_r_token=self.config.use_meanflow, drop_think=drop_think)
        identity = row_identity(tuple(digests), tuple(cond), seed) if images else ""
        text = self.text_plan(ex, bot_task, spec, explicit)
        resolved = Resolved(mode, spec, guidance, cfg_factor, float(rescale), bot_task, images, identity, text)
        params = attrs.evolve(
            p, height=bucket.height, width=bucket.width, num_frames=1, guidance_scale=guidance, seed=seed,
            num_inference_steps=p.num_inference_steps or self.gen_config.diff_infer_steps,
            flow_shift=p.flow_shift if p.flow_shift is not None else self.gen_config.flow_shift, output_type="image")
        return resolved, {"params": params}

    def text_plan(self, ex: Mapping[str, Any], bot_task: str | None, spec: LayoutSpec,
                  size_given: bool) -> TextPlan | None:
        """The text stage of a request: a think / recaption task (unless the client supplied the CoT text) and
        whether the ratio token picks the bucket; ``None`` when there is nothing to generate."""
        task = text_task(ex.get("bot_task", self.gen_config.bot_task)) if bot_task is not None else None
        if spec.cot_text:
            task = None  # the client's CoT is used as given
        ratio = wants_ratio(bot_task, ex.get("image_size"), size_given)
        budget, temperature, top_k, top_p = text_sampling(ex, self.text_defaults, self.text_max_new_tokens)
        if task is None and not ratio:
            return None
        return TextPlan(task, ratio, budget, temperature, top_k, top_p)

    def prepare_layout(self, request_id: str, resolved: Resolved) -> PreparedLayout:
        """Tokenise once and attach the KV requests (one per CFG row) with their prefix block hashes."""
        layout = self.tokenizer.layout(resolved.spec)
        hashes = None
        if self.pool is not None:
            hashes = tuple(block_hashes(row, layout.prefix_len, self.pool.block_size, resolved.identity)
                           for row in layout.tokens)
        return PreparedLayout(layout, kv_requests(request_id, layout, resolved.cfg_factor, hashes), resolved.identity)

    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        if request.prepared:
            return request
        resolved, changes = self.resolve(request)
        if self.kv_mode == "paged_scheduler":
            resolved = attrs.evolve(resolved, prepared_layout=self.prepare_layout(request.request_id, resolved))
        return request.evolve(params=changes["params"], modalities=("image",), prepared=True, plan=resolved)

    def batch_key(self, request: GenerationRequest) -> Hashable:
        r = request.plan if isinstance(request.plan, Resolved) else None
        if r is not None and r.text is not None and r.text.ratio:
            return (request.batch_key(), request.request_id)  # its bucket is known only after the text stage
        return (request.batch_key(), None if r is None else (r.mode, r.cfg_factor, r.guidance_rescale))

    # ------------------------------------------------------------------------------------------ encode
    def layout_of(self, request: GenerationRequest) -> SequenceLayout:
        """The prepared layout (paged mode) or a local tokenisation (dense mode); equal by construction."""
        resolved = request.plan_as(Resolved)
        prepared = resolved.prepared_layout
        if self.kv_mode == "paged_scheduler" and prepared is None:
            raise ValueError(f"paged_scheduler request {request.request_id} did not produce DiffusionKVRequest "
                             "records (it was not preprocessed by this pipeline)")
        if self.kv_mode == "dense_legacy" and prepared is not None:
            raise ValueError(f"dense_legacy request {request.request_id} unexpectedly contains a prepared layout "
                             "with DiffusionKVRequest records")
        if prepared is not None:
            if not isinstance(prepared, PreparedLayout):
                raise TypeError(f"HunyuanImage3 expected prepared_layout to be PreparedLayout, got "
                                f"{type(prepared).__name__}")
            if prepared.layout.rows != resolved.cfg_factor or len(prepared.kv_requests) != resolved.cfg_factor:
                raise ValueError(f"prepared branches do not match execution CFG layout: rows={prepared.layout.rows}, "
                                 f"kv_requests={len(prepared.kv_requests)}, cfg_factor={resolved.cfg_factor}")
            return prepared.layout
        return self.tokenizer.layout(resolved.spec)

    def cond_features(self, request: GenerationRequest, layout: SequenceLayout) -> CondFeatures | None:
        """VAE latents (sampled with the request's seed) and aligned ViT tokens of the condition images."""
        resolved = request.plan_as(Resolved)
        if not resolved.images:
            return None
        gen = torch.Generator(device="cpu").manual_seed(output_seeds(request)[0])
        factor = self.config.vae_downsample_factor[0]
        latents, vit = [], []
        for img, sec in zip(resolved.images, layout.cond):
            px = vae_pixels(img, sec.vae_w * factor, sec.vae_h * factor).to(self.device)
            mean, logvar = self.model.vae.encode_moments(px)
            noise = torch.randn(mean.shape, generator=gen, dtype=torch.float32).to(self.device, mean.dtype)
            z = (mean + torch.exp(0.5 * logvar) * noise - self.model.vae.shift_factor) * self.model.vae.scaling_factor
            latents.append(z[0, :, 0])
            inputs = vit_inputs(self.vit_processor, img)
            vit.append(self.model.vision_features(inputs["pixel_values"].to(self.device),
                                                  inputs["pixel_attention_mask"].to(self.device),
                                                  inputs["spatial_shapes"].to(self.device))[0])
        return CondFeatures(latents, vit)

    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        reqs = list(requests)
        if not reqs:
            raise ValueError("encode() needs at least one request")
        if not all(r.prepared and isinstance(r.plan, Resolved) for r in reqs):
            raise ValueError("encode() takes preprocessed requests (call preprocess() first)")
        first = reqs[0].params
        steps, shift = first.num_inference_steps, first.flow_shift
        if steps is None or shift is None:
            raise ValueError("encode() takes preprocessed requests (steps and shift are filled by preprocess)")
        grid = sigmas(steps, shift, self.sampler_grid)
        with lora_base_only():  # the text stage writes on the base weights (its rows are text jobs, not outputs)
            texts = self.run_text_stage(reqs)
        items, latents = [], []
        for i, r in enumerate(reqs):
            result = texts.get(i)
            layout = self.layout_of(r) if result is None else result.layout
            # an adapted request's prompt K/V is recomputed with its adapters (the text stage's are the base's)
            past = None if result is None or not self.reuse_text_kv or _adapted(r) else result.past
            mine = self._cfg_row(layout.rows)
            if past is not None and mine is not None:  # CFG-parallel: this rank keeps its row's K/V only
                past = past.row(mine)
            gen = torch.Generator(device="cpu").manual_seed(output_seeds(r)[0])
            # drawn in bf16 as the reference does (same seed, same image), kept in fp32 between steps (exact)
            latents.append(initial_noise((1, self.config.latent_channels, layout.gen_h, layout.gen_w), gen,
                                         torch.float32))
            items.append({"request": r, "layout": layout, "tokens": layout.token_tensor(self.device),
                          "rope": self.model.rope(layout, self.device),
                          "past": past,
                          "cond": None if result is None else result.cond, "cond_ready": result is not None,
                          "pool_hit_tokens": 0,
                          "text": None if result is None else result.text,
                          "text_metrics": {} if result is None else {
                              **result.metrics, "text_reused_tokens": float(result.reused_tokens)}})
        return DenoiseState(requests=reqs, num_steps=steps,
                            latents=torch.cat(latents).to(self.device), timesteps=model_timesteps(grid),
                            extras={"items": items, "sigmas": grid.tolist()})

    @property
    def text_stage(self) -> TextStage:
        if self._text_stage is None:
            self._text_stage = TextStage(self.model, self.tokenizer, self.device, pool=self.pool)
        return self._text_stage

    def run_text_stage(self, reqs: Sequence[GenerationRequest]) -> dict[int, Any]:
        """The text stage of the requests that have one (batched where their prompts are equally long); by
        request index. Its results carry the image layout and every CFG row's prefix K/V; with the paged pool,
        resident prompt blocks skip the text prefill and the rows' prefix blocks are published."""
        jobs, where = [], []
        for i, r in enumerate(reqs):
            resolved = r.plan_as(Resolved)
            if resolved.text is not None and resolved.text.active:
                # an edit's condition features (the same for the text and the image stage: grids precede the CoT)
                cond = self.cond_features(r, self.tokenizer.layout(resolved.spec)) if resolved.images else None
                jobs.append(TextJob(resolved.spec, resolved.text, output_seeds(r)[0], cond, resolved.identity))
                where.append(i)
        if not jobs:
            return {}
        def progress(job: int, written: int, budget: int) -> None:  # the request's job shows phase "think"
            report_stage_progress("think", written, budget, row=where[job])

        return dict(zip(where, self.text_stage.run(jobs, on_progress=progress)))

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None:
        idx = list(keep)
        if not idx:
            return None
        state.requests = [state.requests[i] for i in idx]
        state.extras["items"] = [state.extras["items"][i] for i in idx]
        state.latents = state.latents[torch.tensor(idx, device=state.latents.device)]
        return state

    # ------------------------------------------------------------------------------------------ step checkpoints
    def export_step_state(self, state: DenoiseState, row: int) -> dict[str, Any]:
        """Request ``row``'s step state: its latents (Euler: no history, no noise after ``encode``) and the prompt
        K/V the steps keep (``kv_reuse``): a resumed step that recomputed it would take another attention path
        and differ in the last bits. Only the cached prefix is saved; the scratch space is reallocated."""
        past = state.extras["items"][row]["past"]
        kv = None if past is None else {
            "length": past.length, "capacity": int(past.layers[0][0].shape[1]) if past.layers else 0,
            "k": [k[:, :past.length] for k, _ in past.layers], "v": [v[:, :past.length] for _, v in past.layers]}
        return {"latents": state.latents[row:row + 1], "past": kv}

    def import_step_state(self, state: DenoiseState, saved: dict[str, Any]) -> DenoiseState:
        """Put an exported step state into a fresh ``encode`` of its request (alone)."""
        state.latents = saved["latents"].to(state.latents.device, state.latents.dtype)
        kv = saved["past"]
        past = None
        if kv is not None:
            layers = []
            for k, v in zip(kv["k"], kv["v"]):
                full_k = k.new_zeros((k.shape[0], kv["capacity"], *k.shape[2:]), device=self.device)
                full_v = v.new_zeros((v.shape[0], kv["capacity"], *v.shape[2:]), device=self.device)
                full_k[:, :kv["length"]] = k
                full_v[:, :kv["length"]] = v
                layers.append((full_k, full_v))
            past = PrefixKV(layers, int(kv["length"]))
        state.extras["items"][0]["past"] = past
        return state

    # ------------------------------------------------------------------------------------------ denoise
    def _ensure_cond(self, item: dict[str, Any]) -> CondFeatures | None:
        if not item["cond_ready"]:
            item["cond"] = self.cond_features(item["request"], item["layout"])
            item["cond_ready"] = True
        return item["cond"]

    def _pooled_prefix(self, item: dict[str, Any],
                       row: int | None = None) -> tuple[PrefixKV | None, list[tuple[str, ...]]]:
        """On a pool hit: the common leading blocks of every CFG row (of ``row`` only, on a CFG rank) as a prefix
        cache (pins released after the copy). Returns the cache (or None) and the rows' block hashes for
        publishing."""
        prepared = item["request"].plan_as(Resolved).prepared_layout
        if self.pool is None or prepared is None:
            return None, []
        hashes = [kr.block_hashes for kr in prepared.kv_requests]
        if row is not None:
            hashes = hashes[row:row + 1]
        hits = [self.pool.acquire(h) for h in hashes]
        n = min(hits) if hits else 0
        past = None
        try:
            if n > 0:
                past = PrefixKV(self.pool.gather_rows([h[:n] for h in hashes], item["layout"].gen_end),
                                n * self.pool.block_size)
        finally:
            for h, k in zip(hashes, hits):
                self.pool.release(h[:k])
        item["pool_hit_tokens"] = 0 if past is None else past.length
        return past, hashes

    @torch.no_grad()
    def predict(self, state: DenoiseState, step: int) -> torch.Tensor:
        preds = []
        t_value = float(state.timesteps[step])
        for i, item in enumerate(state.extras["items"]):
            resolved = item["request"].plan_as(Resolved)
            layout: SequenceLayout = item["layout"]
            rows = layout.rows
            mine = self._cfg_row(rows)  # CFG-parallel: this rank computes one row, the other rank the other
            tokens = item["tokens"] if mine is None else item["tokens"][mine:mine + 1]
            local = rows if mine is None else 1
            lat = state.latents[i:i + 1].expand(local, -1, -1, -1)
            t = torch.full((local,), t_value, device=self.device, dtype=torch.float32)
            past = item["past"]  # under CFG-parallel: the K/V of this rank's row only
            hashes: list[Any] = []
            if past is None and not _adapted(item["request"]):  # pooled blocks hold the base weights' K/V
                past, hashes = self._pooled_prefix(item, mine)
            needs_cond = past is None or past.length <= (layout.cond[-1].vit_end if layout.cond else -1)
            cond = self._ensure_cond(item) if needs_cond else None
            with lora_sample_rows([i] * local):  # every CFG row is request i's (one output per request)
                pred, kept = self.model.denoise(layout, tokens, item["rope"], lat, t, past=past, cond=cond,
                                                guidance=resolved.guidance)
            if mine is not None:  # both rows on every rank (one all-gather), so the ranks' latents stay equal
                from omnicore.plugin import cfg_branches

                pred = torch.cat(cfg_branches(self.parallel, [pred.detach] * 2))  # a view of this rank's row
            if kept is not None:
                if self.kv_reuse:
                    item["past"] = kept
                if hashes and self.pool is not None:
                    for r, h in enumerate(hashes):
                        self.pool.publish(h, [k[r, :kept.length] for k, _ in kept.layers],
                                          [v[r, :kept.length] for _, v in kept.layers])
            elif not self.kv_reuse:
                item["past"] = None
            if rows == 2:
                preds.append(guide(pred[:1], pred[1:], resolved.guidance, resolved.guidance_rescale))
            else:
                preds.append(pred)
        return torch.cat(preds)

    @torch.no_grad()
    def update(self, state: DenoiseState, step: int, prediction: torch.Tensor) -> DenoiseState:
        s = state.extras["sigmas"]
        state.latents = euler_step(state.latents, prediction, s[step], s[step + 1])
        state.step_index = step + 1
        return state

    # ------------------------------------------------------------------------------------------ decode
    @torch.no_grad()
    def _decode_image(self, latents: torch.Tensor, parallel: Any = None) -> torch.Tensor | None:
        """``[1, C, h, w]`` -> ``[1, 3, H, W]`` in [0, 1], tiled when ``vae_tiles`` asks (its tiles decoded across
        the ranks of ``parallel``: ``None`` on the ranks other than 0), under the decode precision."""
        tiles = self.vae_tiles
        with (torch.autocast(self.device.type, dtype=self.vae_decode_dtype) if self.vae_decode_dtype is not None
              else contextlib.nullcontext()):
            if tiles is not None and tiles.splits(latents):
                return tiled_decode(self.model.vae.decode, latents, tiles, parallel)
            return self.model.vae.decode(latents).float()

    def decode(self, state: DenoiseState) -> list[Output]:
        outputs = []
        par = self.parallel if self.decode_on_every_rank else None  # parallel VAE decode (tiles per rank)
        if par is not None and not par.is_driver:  # a worker: its share of every tiled image's tiles, no outputs
            for i in range(len(state.extras["items"])):
                latents = state.latents[i:i + 1].float()
                if self.vae_tiles is not None and self.vae_tiles.splits(latents):
                    self._decode_image(latents, par)
            return []
        for i, item in enumerate(state.extras["items"]):
            request = item["request"]
            decoded = self._decode_image(state.latents[i:i + 1].float(), par)
            assert decoded is not None  # rank 0 receives every tile
            image = decoded[0]  # [3, H, W] in [0, 1]
            pixels = (image.permute(1, 2, 0) * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
            metrics = {"kv_pool_hit_tokens": float(item["pool_hit_tokens"]), **item.get("text_metrics", {})}
            outputs.append(Output(kind="image", frames=np.ascontiguousarray(pixels[None]),
                                  request_id=request.request_id, index=0, seed=request.params.seed, metrics=metrics,
                                  text=item.get("text")))
        return outputs

    def kv_pool_stats(self) -> dict[str, int]:
        if self.pool is None:
            return {}
        return {**self.pool.stats.as_dict(), "resident_blocks": len(self.pool), "max_blocks": self.pool.max_blocks}
