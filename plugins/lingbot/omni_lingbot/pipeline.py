"""``LingBotPipeline``: the omnicore pipeline protocol for LingBot-Video.

Per batch of requests with equal batch keys: ``encode`` builds text embeddings, the TI2V clean latents and
the initial noise (one generator per request, seeded with the request's seed), ``predict`` runs the DiT with
classifier-free guidance (none, two sequential forwards, or one packed B=2N forward with ``batch_cfg``),
``update`` takes a FlowUniPC step, ``decode`` runs the VAE. For TI2V the clean first latent frame is written
back before every DiT call and after every scheduler step, so it survives every CFG mode and step caches.

Refiner (``extra.run_refiner``, checkpoints with a ``refiner/`` DiT): the engine's step count is the base steps
plus the refiner's, so progress, cancellation and ETA cover both stages. The update of the last base step decodes
the base video and builds the refiner's start latents (:mod:`omni_lingbot.refiner`); the following steps run the
refiner DiT on its own low-noise schedule, text (the same prompt embedding; zeros or the negative prompt as the
negative) and guidance. ``decode`` then yields the refined size and the refiner's frame rate.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnicore.plugin import (
    BasePipeline,
    ConfigError,
    DenoiseState,
    GenerationRequest,
    InvalidRequest,
    LoadOptions,
    MediaInput,
    Output,
    cfg_branches,
    check_extra,
    check_inputs,
    data_parallel,
    holds_text_encoder,
    hook_context,
    output_seeds,
    parallel_vae_decode_enabled,
    read_json,
    resolve_roles,
    shared_encode,
    text_encoder_on_host,
)

from .conditions import align_image, apply_clean_prefix, load_image
from .loader import PLUGIN, CheckpointError, load_transformer
from .plan import LingBotPlan, Sampling, caption_of, plan_of
from .plugin import MODEL_SPEC
from .prompts import PromptTexts, load_prompt_texts
from .refiner import refiner_sigmas, refiner_stage, start_latents
from .request_rules import resolve_request
from .sampler import (
    base_sigmas,
    low_noise_sigmas,
    make_scheduler,
    model_timestep,
    read_scheduler_config,
    restore_scheduler_state,
    scheduler_state,
)
from .text_encoder import LingBotTextEncoder
from .vae import LingBotVAE


def pad_embeddings(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``[L_i, D]`` rows to ``[N, max L, D]`` with a boolean mask (True = real token)."""
    longest = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1])
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return out, mask


def sparse_attention_options(model_options: Any) -> dict[str, Any]:
    """The block-sparse planner's settings from the deployment options ``rainfusion_sparsity`` /
    ``rainfusion_skip_layers`` (unset ones keep the planner's defaults)."""
    opts = dict(model_options or {})
    pairs = (("sparsity", opts.get("rainfusion_sparsity")), ("skip_layers", opts.get("rainfusion_skip_layers")))
    return {key: value for key, value in pairs if value is not None}


class LingBotPipeline(BasePipeline):
    """Loads a LingBot repository and generates images (T2I) or videos (T2V, TI2V)."""

    spec = MODEL_SPEC
    #: Build the DiT's packed layout, RoPE table and text index once per request branch and reuse them every step
    #: (bit-identical either way; off only to measure or to compare against the rebuilding path).
    reuse_forward_metadata: bool = True
    #: this rank's omnicore.parallel.ParallelContext under ``--parallel`` (None in a single-process engine)
    parallel: Any = None
    #: under ``--parallel`` (unless ``parallel_vae_decode=false``): every rank runs :meth:`decode`, decoding its
    #: round-robin share of the VAE tiles of each request that asked for a tiled decode; rank 0 blends them
    decode_on_every_rank: bool = False
    #: ``text_encoder_offload=cpu``: the Qwen3-VL encoder lives in rank 0's host memory and encodes there
    #: (:func:`omnicore.plugin.shared_encode` gives every rank its rows); other ranks hold none (``None``)
    text_encoder_on_host: bool = False

    def __init__(self, transformer: Any, text_encoder: LingBotTextEncoder | None, vae: LingBotVAE,
                 scheduler_config: dict[str, Any], *, device: torch.device, dtype: torch.dtype,
                 path: Path | None = None, refiner: Any = None, prompts: PromptTexts | None = None) -> None:
        self.transformer = transformer
        self.refiner = refiner  # the MoE package's refiner DiT, or None
        self.text_encoder = text_encoder
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.device = device
        self.dtype = dtype
        self.path = path
        self.prompts = prompts if prompts is not None else PromptTexts()  # template + default negative prompts

    # ------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: Path | str, options: LoadOptions) -> LingBotPipeline:
        precision = getattr(options, "vae_decode_precision", None)
        if precision not in (None, "fp32"):  # the Wan VAE runs in float32 here, as in the reference pipeline
            raise ConfigError("vae_decode_precision", f"LingBot decodes its VAE in fp32 only, got {precision!r}; "
                                                      "leave it unset or use fp32")
        root = Path(path)
        read_json(root / "model_index.json", plugin=PLUGIN)  # a clear error when this is not a repository at all
        for part in ("transformer", "text_encoder", "processor", "vae"):
            if not (root / part).is_dir():
                raise CheckpointError(PLUGIN, root, f"missing the {part}/ folder")
        device, dtype = options.device(), options.torch_dtype()
        parallel = options.parallel

        def dit(folder: Path) -> Any:
            attention = None
            if options.attention is not None:
                cfg = read_json(folder / "config.json", plugin=PLUGIN, component=folder.name)
                head_dim = int(cfg.get("hidden_size", 2048)) // int(cfg.get("num_attention_heads", 16))
                attention = options.select_attention(dtype, head_dim, packed_varlen=True)
            ep = (parallel.ep_rank, parallel.ep) if parallel is not None and getattr(parallel, "ep", 1) > 1 else None
            model = load_transformer(folder, device=device, dtype=dtype, attention=attention,
                                     ops=options.platform.ops, ep=ep)  # under ep: only this rank's experts read
            if parallel is not None and parallel.ulysses > 1:
                model.enable_ulysses(parallel)
            if parallel is not None and getattr(parallel, "ep", 1) > 1:  # this rank keeps 1/ep of the experts
                dispatch = (getattr(options, "model_options", None) or {}).get("ep_dispatch") or "all_to_all"
                model.enable_expert_parallel(parallel, str(dispatch))
            model.enable_sparse_attention(sparse_attention_options(options.model_options))  # plan-running backends
            return model

        transformer = dit(root / "transformer")
        # loaded eagerly when present: the refiner is a second full DiT, so it adds its whole weight size to the
        # resident memory (with offload="model" it waits on the CPU and visits the device for its forwards only)
        refiner = dit(root / "refiner") if (root / "refiner").is_dir() else None
        if refiner is not None:
            for key in ("text_dim", "in_channels", "out_channels"):
                mine, base = getattr(refiner.config, key), getattr(transformer.config, key)
                if mine != base:
                    raise CheckpointError(PLUGIN, root / "refiner", f"refiner {key} {mine} differs from the "
                                                                    f"transformer's {base}; the two stages share "
                                                                    "text and latents")
        # model options first, then files in the checkpoint, then built-in texts (omni_lingbot.prompts)
        prompts = load_prompt_texts(root, getattr(options, "model_options", None))
        on_host = text_encoder_on_host(options.model_options)  # cpu: rank 0's host memory only, encoding there
        text_encoder = LingBotTextEncoder.from_pretrained(
            root / "text_encoder", root / "processor", device=torch.device("cpu") if on_host else device, dtype=dtype,
            template=prompts.template) if holds_text_encoder(parallel, options.model_options) else None
        vae = LingBotVAE.from_pretrained(root / "vae", device=device, ops=options.platform.ops)
        scheduler_config = read_scheduler_config(root / "scheduler" / "scheduler_config.json")
        pipeline = cls(transformer, text_encoder, vae, scheduler_config, device=device, dtype=dtype, path=root,
                       refiner=refiner, prompts=prompts)
        pipeline.parallel = parallel
        pipeline.text_encoder_on_host = on_host
        pipeline.decode_on_every_rank = parallel_vae_decode_enabled(parallel, options.model_options)
        return pipeline

    # ------------------------------------------------------------------------------------------ admission
    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        """Apply every request rule once, fill defaults, load the reference image; returns a prepared copy."""
        if request.prepared:
            return request
        # roles against the spec (the engine did it already; direct callers get it here): an image given without
        # a role is the TI2V first frame, and any other role or kind is rejected naming ``inputs[i]``
        check_extra(request.extra, self.spec)
        request = resolve_roles(request, self.spec.capabilities, self.spec.name)
        check_inputs(request, self.spec.capabilities, self.spec.name)
        first_frames = request.media("image", "first_frame")
        resolved = resolve_request(
            prompt=request.prompt, negative_prompt=request.negative_prompt, modalities=request.modalities,
            num_images=len(first_frames), num_videos=len(request.videos), num_audios=len(request.audios),
            params=request.params, extra=request.extra, defaults=self.spec.defaults,
            device_type=self.device.type,  # batch_cfg "auto": two passes on CPU, packed on CUDA/NPU
        )
        if resolved.refiner is not None and self.refiner is None:
            raise InvalidRequest("extra.run_refiner", "this checkpoint has no refiner/ stage (the MoE package "
                                                      "ships one); remove run_refiner")
        negative = resolved.negative_prompt
        if request.negative_prompt is None and request.extra.get("negative_prompt") is None:
            negative = self.prompts.negative_prompt(resolved.mode)  # the deployment's default for this mode
        inputs = tuple(MediaInput("image", "first_frame", load_image(m.data, i)) for i, m in enumerate(first_frames))
        params = request.params.with_defaults(
            self.spec.defaults, height=resolved.height, width=resolved.width, num_frames=resolved.num_frames,
            fps=resolved.fps, flow_shift=resolved.shift,
            output_type="image" if resolved.mode == "t2i" else "video",
        )
        # the refiner's work, for the engine's limits and work budget
        stages = () if resolved.refiner is None else (refiner_stage(resolved.refiner, params, request.extra),)
        return request.evolve(
            prompt=resolved.caption, negative_prompt=negative, inputs=inputs, params=params,
            modalities=("image",) if resolved.mode == "t2i" else ("video",), prepared=True,
            plan=LingBotPlan.from_resolved(resolved), stages=stages,  # the record encode/decode read
        )

    def batch_key(self, request: GenerationRequest) -> Hashable:
        return (request.batch_key(), *plan_of(request).batch_key(request.params.fps))

    # ------------------------------------------------------------------------------------------ encode
    def _sigmas(self, request: GenerationRequest) -> np.ndarray:
        s, low_noise = Sampling.of(request), plan_of(request).low_noise
        if low_noise.threshold is not None:
            return low_noise_sigmas(s.steps, s.shift, low_noise.threshold, low_noise.tail_steps)
        return base_sigmas(s.steps, s.shift)

    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        reqs = self.batch_requests(requests)
        first = reqs[0]
        plan = plan_of(first)
        p, mode = Sampling.of(first), plan.mode
        vae = self.vae
        latent_shape = (1, vae.z_dim, (p.num_frames - 1) // vae.temporal_ratio + 1, p.height // vae.spatial_ratio,
                        p.width // vae.spatial_ratio)
        use_cfg = p.guidance_scale > 1.0
        # the engine fills every request's seed before preprocess (output_seeds raises when one is missing)
        generators = [torch.Generator(device=self.device).manual_seed(output_seeds(r)[0]) for r in reqs]

        pixels: list[torch.Tensor | None] = [None] * len(reqs)
        clean = None
        if mode == "ti2v":
            pixels = [align_image(r.images[0], p.height, p.width) for r in reqs]
            # the posterior sample comes first from each request's generator (keeps the official RNG order)
            cleans = []
            for r, px, g in zip(reqs, pixels, generators):
                assert px is not None
                with self.vae.tiling(plan_of(r).vae_tiling):
                    cleans.append(self.vae.encode(px, g))
            clean = torch.cat(cleans).to(self.device)
        noise = torch.cat([torch.randn(latent_shape, generator=g, device=self.device, dtype=torch.float32)
                           for g in generators])
        if clean is not None:
            apply_clean_prefix(noise, clean)

        cond_rows = [self._encode_text(caption_of(r), px) for r, px in zip(reqs, pixels)]
        extras: dict[str, Any] = {"mode": mode, "clean": clean, "guidance": float(p.guidance_scale),
                                  "use_cfg": use_cfg, "batch_cfg": plan.batch_cfg and use_cfg}
        uncond_rows: list[torch.Tensor] = []
        if use_cfg:
            if plan.null_cond_clone_zero:
                uncond_rows = [torch.zeros_like(row) for row in cond_rows]
            else:
                # an explicitly empty negative prompt still goes through the template (empty user turn)
                uncond_rows = [self._encode_text(r.negative_prompt or "", px) for r, px in zip(reqs, pixels)]
        self._set_text(extras, cond_rows, uncond_rows)

        scheduler = make_scheduler(self.scheduler_config, self._sigmas(first))
        extras["scheduler"] = scheduler
        timesteps = scheduler.timesteps
        refiner = plan.refiner
        if refiner is not None:
            # one step index space for both stages: [base timesteps ; refiner timesteps]
            refiner_scheduler = make_scheduler(self.scheduler_config, refiner_sigmas(refiner))
            extras["refiner_scheduler"] = refiner_scheduler
            extras["base_steps"] = len(timesteps)
            timesteps = torch.cat([timesteps, refiner_scheduler.timesteps])
            if refiner.guidance_scale > 1.0 and not refiner.null_cond_clone_zero:
                base_negative = use_cfg and not plan.null_cond_clone_zero
                extras["refiner_uncond_rows"] = uncond_rows if base_negative else [
                    self._encode_text(r.negative_prompt or "", px) for r, px in zip(reqs, pixels)]
        return DenoiseState(requests=reqs, num_steps=len(timesteps), latents=noise, timesteps=timesteps,
                            extras=extras)

    def _encode_text(self, caption: str, image: torch.Tensor | None) -> torch.Tensor:
        """One caption's rows ``[L, D]``: from the resident encoder, or (``text_encoder_offload=cpu``) from the
        host's, run on rank 0 alone and shared with every rank, moved to the device."""
        encoder = self.text_encoder
        if not self.text_encoder_on_host:
            assert encoder is not None
            return encoder.encode(caption, image)
        compute = None if encoder is None else (lambda: [encoder.encode(caption, image)])
        [rows] = shared_encode(self.parallel, compute, device=self.device)
        return rows

    @staticmethod
    def _set_text(extras: dict[str, Any], cond_rows: list[torch.Tensor], uncond_rows: list[torch.Tensor]) -> None:
        """Padded text batches for each CFG mode (built once per batch, reused every step). New text means new
        masks, so the DiT metadata built from the old ones is dropped here."""
        extras["cond_rows"], extras["uncond_rows"] = cond_rows, uncond_rows
        extras["forward_metadata"] = {}
        extras["cond"] = pad_embeddings(cond_rows)
        if uncond_rows:
            extras["uncond"] = pad_embeddings(uncond_rows)
            if extras["batch_cfg"]:
                # [positive_1..N ; negative_1..N], right-padded to the longest row
                extras["pair"] = pad_embeddings(cond_rows + uncond_rows)

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None:
        """Drop cancelled requests from a running batch: slice latents, clean prefixes, text and the sampler's
        multistep history (all batch-first), so the survivors continue exactly as before."""
        idx = list(keep)
        if not idx:
            return None
        ex = state.extras
        index = torch.tensor(idx, device=state.latents.device)
        state.requests = [state.requests[i] for i in idx]
        state.latents = state.latents[index]
        if ex["clean"] is not None:
            ex["clean"] = ex["clean"][index]
        self._set_text(ex, [ex["cond_rows"][i] for i in idx], [ex["uncond_rows"][i] for i in idx] if
                       ex["uncond_rows"] else [])
        if ex.get("refiner_uncond_rows"):
            ex["refiner_uncond_rows"] = [ex["refiner_uncond_rows"][i] for i in idx]
        for key in ("scheduler", "refiner_scheduler"):
            scheduler = ex.get(key)
            if scheduler is None:
                continue
            scheduler.model_outputs = [None if m is None else m[index] for m in scheduler.model_outputs]
            if scheduler.last_sample is not None:
                scheduler.last_sample = scheduler.last_sample[index]
        return state

    # ------------------------------------------------------------------------------------------ denoise
    @property
    def block_loop(self) -> Any:
        """The DiT's block loop for block-level caches (first-block cache): each block takes and returns the
        packed joint hidden stream as its first argument."""
        from omnicore.plugin import BlockLoop

        return BlockLoop(blocks="transformer.blocks", streams=("hidden_states",))

    @property
    def compile_regions(self) -> tuple[str, ...]:
        """Block lists compiled by ``--compile`` (the DiT's, and the refiner's when the package has one)."""
        return ("transformer.blocks",) + (("refiner.blocks",) if self.refiner is not None else ())

    @property
    def offload_modules(self) -> dict[str, Any]:
        """Modules entered through ``forward`` (model-level offload). The VAE is entered through encode/decode
        and stays resident; a host-resident text encoder (``text_encoder_offload=cpu``) never visits the device."""
        modules = {"transformer": self.transformer}
        if self.text_encoder is not None and not self.text_encoder_on_host:
            modules["text_encoder"] = self.text_encoder.model
        if self.refiner is not None:
            modules["refiner"] = self.refiner
        return modules

    def _forward(self, extras: dict[str, Any], branch: str, latents: torch.Tensor, timestep: torch.Tensor,
                 text: tuple[torch.Tensor, torch.Tensor], refiner: bool = False) -> torch.Tensor:
        """One DiT call; ``branch`` names it ("cond", "uncond", "cfg") for per-branch cache state. The refiner's
        calls get their own names so that no cache state is shared between the stages."""
        embeds, mask = text
        model = self.refiner if refiner else self.transformer
        name = f"refiner.{branch}" if refiner else branch
        hidden = latents.to(self.dtype)
        embeds, mask = embeds.to(self.device, self.dtype), mask.to(self.device)
        kwargs: dict[str, Any] = {}
        metadata = self._metadata(extras, name, model, hidden, embeds, mask)
        if metadata is not None:
            kwargs["metadata"] = metadata
        with hook_context(name):
            out = model(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds,
                        encoder_attention_mask=mask, **kwargs)
        return out.float()

    def _metadata(self, extras: dict[str, Any], name: str, model: Any, hidden: torch.Tensor, embeds: torch.Tensor,
                  mask: torch.Tensor) -> Any:
        """The DiT's forward metadata of branch ``name``, built at its first call and reused at every later step.
        It lives in ``extras["forward_metadata"]``, which :meth:`_set_text` empties whenever the text (and so the
        mask) changes; a host-side shape check rebuilds it if the latents changed shape. None when reuse is off
        or the DiT (e.g. a test double) has no ``forward_metadata``."""
        build = getattr(model, "forward_metadata", None)
        if not self.reuse_forward_metadata or build is None:
            return None
        cache = extras.setdefault("forward_metadata", {})
        metadata = cache.get(name)
        if metadata is None or not metadata.matches(hidden, embeds):
            metadata = cache[name] = build(hidden, embeds, mask)
        return metadata

    @torch.no_grad()
    def predict(self, state: DenoiseState, step: int) -> torch.Tensor:
        """The guided velocity ``v_u + g * (v_c - v_u)`` for the current latents (``v_c`` alone without CFG)."""
        ex = state.extras
        latents = state.latents
        if ex["clean"] is not None:
            apply_clean_prefix(latents, ex["clean"])
        n = latents.shape[0]
        # the reference rounds the DiT's timestep input per weight dtype (bf16/fp16: sigma and the product)
        t = model_timestep(state.timesteps[step], self.dtype).to(self.device).expand(n)
        refining = ex.get("phase") == "refiner"
        par = self.parallel
        if not ex["use_cfg"]:
            if par is not None and par.cfg > 1:  # no second branch: CFG ranks split the batch instead
                embeds, mask = ex["cond"]
                split = data_parallel(par, n, lambda rows: self._forward(
                    ex, "cond.rows", latents[rows], t[rows], (embeds[rows], mask[rows]), refining))
                if split is not None:
                    return split
            return self._forward(ex, "cond", latents, t, ex["cond"], refining)
        if par is not None and par.cfg > 1:  # CFG-parallel: one branch per CFG rank, predictions exchanged
            v_cond, v_uncond = cfg_branches(par, [
                lambda: self._forward(ex, "cond", latents, t, ex["cond"], refining),
                lambda: self._forward(ex, "uncond", latents, t, ex["uncond"], refining)])
        elif ex["batch_cfg"]:
            both = self._forward(ex, "cfg", torch.cat([latents, latents]), torch.cat([t, t]), ex["pair"], refining)
            v_cond, v_uncond = both[:n], both[n:]
        else:
            v_cond = self._forward(ex, "cond", latents, t, ex["cond"], refining)
            v_uncond = self._forward(ex, "uncond", latents, t, ex["uncond"], refining)
        return v_uncond + ex["guidance"] * (v_cond - v_uncond)

    @torch.no_grad()
    def update(self, state: DenoiseState, step: int, prediction: torch.Tensor) -> DenoiseState:
        ex = state.extras
        state.latents = ex["scheduler"].step(prediction, state.timesteps[step], state.latents).prev_sample
        if ex["clean"] is not None:
            apply_clean_prefix(state.latents, ex["clean"])
        state.step_index = step + 1
        if step + 1 == ex.get("base_steps"):
            self._enter_refiner(state)
        return state

    def _enter_refiner(self, state: DenoiseState) -> None:
        """Switch a finished base batch to the refiner stage: start latents, clean prefix, scheduler, text, CFG."""
        options = plan_of(state.requests[0]).refiner
        if options is None:
            raise ValueError("the refiner stage was entered for a request without refiner options")
        state.latents, state.extras["clean"] = start_latents(self.vae, state.latents, state.requests, options,
                                                             self.device)
        self._refiner_stage(state)

    def _refiner_stage(self, state: DenoiseState) -> None:
        """The refiner stage's scheduler, guidance and text (its start latents are set by the caller)."""
        ex = state.extras
        options = plan_of(state.requests[0]).refiner
        assert options is not None
        ex["phase"] = "refiner"
        ex["scheduler"] = ex.pop("refiner_scheduler")
        ex["guidance"] = float(options.guidance_scale)
        ex["use_cfg"] = options.guidance_scale > 1.0
        ex["batch_cfg"] = options.batch_cfg and ex["use_cfg"]  # the refiner's own switch (refiner_batch_cfg)
        uncond: list[torch.Tensor] = []
        if ex["use_cfg"]:
            uncond = ([torch.zeros_like(row) for row in ex["cond_rows"]] if options.null_cond_clone_zero
                      else ex.pop("refiner_uncond_rows"))
        self._set_text(ex, ex["cond_rows"], uncond)

    # ------------------------------------------------------------------------------------------ step checkpoints
    def export_step_state(self, state: DenoiseState, row: int) -> dict[str, Any]:
        """Request ``row``'s step state: latents, TI2V clean prefix, stage, and the UniPC sampler's history rows
        and counters. The sampler draws no noise after ``encode`` (the refiner's start noise is already in the
        latents), so there is no generator state to keep."""
        ex = state.extras
        clean = ex["clean"]
        return {"latents": state.latents[row:row + 1], "clean": None if clean is None else clean[row:row + 1],
                "phase": ex.get("phase", "base"), "scheduler": scheduler_state(ex["scheduler"], row)}

    def import_step_state(self, state: DenoiseState, saved: dict[str, Any]) -> DenoiseState:
        """Put an exported step state into a fresh ``encode`` of its request (alone)."""
        if saved["phase"] == "refiner":
            self._refiner_stage(state)
        state.latents = saved["latents"].to(self.device)
        state.extras["clean"] = None if saved["clean"] is None else saved["clean"].to(self.device)
        restore_scheduler_state(state.extras["scheduler"], saved["scheduler"], self.device)
        return state

    # ------------------------------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Output]:
        """One output per request: an image (one frame) for T2I, else a video at the request's fps (the refiner's
        ``output_fps`` — by default its ``sample_fps`` — after a refiner stage, whose frames also have the
        refiner's size)."""
        outputs = []
        image = state.extras["mode"] == "t2i"
        par = self.parallel if self.decode_on_every_rank else None  # parallel VAE decode of tiled requests
        if par is not None and not par.is_driver:  # a worker: its share of every tiled decode's tiles, no outputs
            for i, request in enumerate(state.requests):
                with self.vae.tiling(plan_of(request).vae_tiling):
                    if self.vae.splits_over_ranks(state.latents[i: i + 1]):
                        self.vae.decode_over_ranks(state.latents[i: i + 1], par)
            return []
        for i, request in enumerate(state.requests):
            plan = plan_of(request)
            with self.vae.tiling(plan.vae_tiling):
                latents = state.latents[i: i + 1]
                if par is not None and self.vae.splits_over_ranks(latents):
                    decoded = self.vae.decode_over_ranks(latents, par)
                    assert decoded is not None  # rank 0 receives every tile
                    frames = decoded[0]
                else:
                    frames = self.vae.decode(latents)[0]  # [F, H, W, 3] in [0, 1]
            pixels = (frames * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
            refiner = plan.refiner
            fps = None if image else refiner.fps if refiner is not None else request.params.fps
            # CFG-parallel ranks run one branch each, which takes precedence over packing (see predict)
            packed = (plan.batch_cfg and (request.params.guidance_scale or 0.0) > 1.0
                      and (self.parallel is None or self.parallel.cfg <= 1))
            outputs.append(Output(
                kind="image" if image else "video", frames=pixels, fps=fps,
                request_id=request.request_id, index=0, seed=request.params.seed,
                # how the base stage ran CFG (1 = one packed forward), and whether the platform chose it
                metrics={"batch_cfg": float(packed),
                         "batch_cfg_auto": float(plan.batch_cfg_source == "auto")},
            ))
        return outputs

