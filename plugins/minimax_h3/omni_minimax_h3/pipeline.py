"""``MiniMaxH3Pipeline``: the omnicore pipeline protocol for MiniMax-H3.

Steps: ``num_inference_steps`` counts DiT calls (omnicore's meaning: progress and caches count them), so a
request's sigma grid has ``steps + 1`` points — the release's 50-point default grid is 49 steps, and diffusers'
``num_inference_steps=N`` is our ``N - 1``.

Per batch (requests of any size and task of one partition, with equal step counts and shifts): ``encode`` presents
and encodes every prompt (Qwen3-VL, layer-50 readout), encodes the keyframes / references with the VAEs, draws the
noise, lays out each output's packed document, lets the DiT prepare it once (RoPE table, refined text) and packs all
of them into one :class:`BatchPlan`; it also computes every step's distinct timesteps on the host (the schedule is
known up front). ``predict`` is one DiT forward for the whole batch; ``update`` an Euler step of the generated rows
(conditioning rows keep their noised anchors); ``decode`` unpacks and runs the video and audio VAEs into an
``Output`` with 24 fps frames and a 32 kHz stereo waveform.

Noise convention (the peer's, diffusers' ``MiniMaxH3ModularPipeline``): one CPU float32 generator per output seeded
with its seed, drawn in the order: one conditioning noise per keyframe / visual reference (its latent's shape),
then the video noise ``[1, 24, T, H/16, W/16]``, then the audio noise directly as rows ``[2·T_a, 32]``. The official
implementation instead seeds a separate generator per condition and draws the condition noise over a longer
latent; everything after the initial noise (anchors at t = 0.999, schedules, updates) is the same in both.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.plugin import (
    STATE_STEP_KEY,
    BasePipeline,
    ConfigError,
    DenoiseState,
    GenerationRequest,
    InvalidRequest,
    LoadOptions,
    Output,
    PluginError,
    check_extra,
    fast_path_gate,
    holds_text_encoder,
    lora_sample_rows,
    materialize,
    output_seeds,
    parallel_vae_decode_enabled,
    schedule_key,
    shared_encode,
    text_encoder_on_host,
)

from . import packing
from .conditions import (
    conditioner_frames,
    encodable_frames,
    fit_keyframe,
    fit_reference_image,
    stereo_at,
    to_rgb,
    video_at_24fps,
)
from .plan import H3Plan, plan_of, resolved_of
from .plugin import DEFAULTS, MODEL_SPEC
from .request_rules import (
    SAMPLE_RATE,
    SEQ_ALIGN,
    Deployment,
    MediaSummary,
    ResolvedRequest,
    canvas_for_ratio,
    resolve_request,
)
from .sampler import euler_step, paired_sigmas, timesteps
from .teacache import BLOCK_RESIDUAL, KEEP_RESIDUAL
from .text_encoder import H3TextEncoder, VideoCondition
from .transformer.attention import enable_sparse_attention
from .vae import H3AudioVAE, H3VideoVAE


def sparse_attention_options(model_options: Any) -> dict[str, Any]:
    """The block-sparse planner's settings (a plan-running backend such as ``npu_rainfusion``) from the
    deployment options ``rainfusion_sparsity`` / ``rainfusion_skip_layers``; unset ones keep its defaults."""
    opts = dict(model_options or {})
    pairs = (("sparsity", opts.get("rainfusion_sparsity")), ("skip_layers", opts.get("rainfusion_skip_layers")))
    return {key: value for key, value in pairs if value is not None}

logger = logging.getLogger("omni_minimax_h3")

CONDITION_VIDEO_T = 0.999  # keyframe / visual reference anchors are held just short of clean
CONDITION_AUDIO_T = 1.0  # reference audio stays clean
FPS = 24.0


@attrs.define(eq=False)
class Item:
    """One output of one request inside a batch."""

    request_index: int
    output_index: int
    seed: int
    resolved: ResolvedRequest
    layout: Any  # the DiT's RequestLayout
    video_rows: int
    audio_rows: int


@attrs.frozen(eq=False)
class VideoReference:
    """A decoded ref2va video and its soundtrack (None when the source has no audio stream)."""

    clip: Any  # omnicore.media.VideoClip
    audio: Any = None  # omnicore.media.AudioClip | None


def _soundtrack(source: Any, field: str) -> Any:
    """The audio stream of a video given as a path or bytes, or None (decoded clips carry no sound)."""
    import os

    from omnicore.plugin import load_media

    if not isinstance(source, (str, bytes, bytearray, os.PathLike)):
        return None
    try:
        return load_media("audio", source, field=field)
    except InvalidRequest:
        return None  # no (decodable) audio stream: the reference conditions on motion alone


def _grid(latents: torch.Tensor) -> tuple[int, int, int]:
    """The ``(t, h, w)`` latent grid of a ``[1, C, t, h, w]`` condition."""
    return int(latents.shape[2]), int(latents.shape[3]), int(latents.shape[4])


class MiniMaxH3Pipeline(BasePipeline):
    """Loads a MiniMax-H3 repository (either partition or both) and generates video with sound."""

    spec = MODEL_SPEC

    def __init__(self, transformers: dict[str, Any], text_encoder: H3TextEncoder | None, video_vae: H3VideoVAE,
                 audio_vae: H3AudioVAE, deployment: Deployment, *, device: Any, dtype: torch.dtype,
                 reference_short_edge: int = 2048, path: Path | None = None) -> None:
        if not transformers:
            raise PluginError("minimax_h3", "no transformer partition loaded")
        self.transformers = transformers  # "fl2va" / "ref2va" -> MiniMaxH3DiT
        # attribute names too, so dotted paths (block loops, offload) reach them
        self.transformer = transformers.get("fl2va")
        self.transformer_ref = transformers.get("ref2va")
        self.text_encoder = text_encoder
        self.video_vae = video_vae
        self.audio_vae = audio_vae
        self.deployment = deployment
        self.device = torch.device(device)
        self.dtype = dtype
        self.reference_short_edge = reference_short_edge
        self.path = path
        # [real | pad] documents padded to 64 rows keep shapes steady on accelerators (graphs, compiled kernels);
        # on the CPU padding is only extra attention work, so requests pack unpadded there.
        self.seq_align = 1 if self.device.type == "cpu" else SEQ_ALIGN
        from .adaln_routing import PartitionAdaLN

        self._adaln_router = PartitionAdaLN(transformers) if len(transformers) > 1 else None

    # ------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: Path | str, options: LoadOptions) -> MiniMaxH3Pipeline:
        """Any downloadable layout (diffusers' modular one, the official ``FL2VA/`` + ``Ref2VA/`` partitions, the
        tiny presets'; see :mod:`omni_minimax_h3.repository`); canvas, shifts and reference size come from the
        repository's own configs."""
        from .loader import load_transformer, read_transformer_config
        from .repository import resolve_layout

        root = Path(path)
        layout = resolve_layout(root)
        dirs = dict(layout.transformers)
        wanted = (options.model_options or {}).get("partition")
        if wanted is not None:
            parts = ("fl2va", "ref2va") if wanted == "combined" else (wanted,)
            missing = [p for p in parts if p not in dirs]
            if missing:
                raise ConfigError("model_options.partition", f"{root} has no {' / '.join(missing)} partition "
                                                             f"(it has {', '.join(sorted(dirs))})")
            dirs = {p: dirs[p] for p in parts}
        device, dtype = options.device(), options.torch_dtype()
        ops = getattr(options.platform, "ops", None)
        parallel = options.parallel
        tp = (parallel.tp_rank, parallel.tp) if parallel is not None and parallel.tp > 1 else None
        transformers = {}
        for part, folder in sorted(dirs.items()):
            attention = None
            if options.attention is not None:
                cfg = read_transformer_config(folder)
                attention = options.select_attention(dtype, cfg.attention_head_dim, packed_varlen=True,
                                                     packed_mask_free=True)
            transformers[part] = load_transformer(folder, device=device, dtype=dtype, attention=attention, ops=ops,
                                                 tp=tp)
            enable_sparse_attention(transformers[part], sparse_attention_options(options.model_options))
        settings = layout.settings
        # text_encoder_offload=cpu: host memory of rank 0 only, whole (never TP-split), encoding on the CPU
        on_host = text_encoder_on_host(options.model_options)
        text_encoder = H3TextEncoder.from_pretrained(
            layout.text_encoder, layout.tokenizer, layout.processor, device=torch.device("cpu") if on_host else device,
            dtype=dtype, layer=settings.text_encoder_layer, tp=None if on_host else tp,
        ) if holds_text_encoder(parallel, options.model_options) else None
        video_vae = H3VideoVAE.from_pretrained(layout.video_vae, device=device,
                                               precision=options.vae_decode_precision, ops=ops)
        patch = next(iter(transformers.values())).config.patch_size
        deployment = Deployment(
            partitions=tuple(sorted(transformers)), canvas_short_edge=settings.canvas_short_edge,
            canvas_max_pixels=settings.canvas_max_pixels, video_shift=settings.video_shift,
            audio_shift=settings.audio_shift, partition_shifts=dict(settings.partition_shifts),
            canvas_multiple=video_vae.spatial_ratio * int(patch[2]),  # a whole number of patches per latent row
        )
        pipeline = cls(transformers, text_encoder, video_vae,
                       H3AudioVAE.from_pretrained(layout.audio_vae, device=device), deployment, device=device,
                       dtype=dtype, reference_short_edge=settings.reference_image_short_edge, path=root)
        pipeline.text_encoder_on_host = on_host
        pipeline.enable_parallel(parallel)
        pipeline.decode_on_every_rank = parallel_vae_decode_enabled(parallel, options.model_options)
        return pipeline

    #: this rank's omnicore.parallel.ParallelContext under ``--parallel`` (None in a single-process engine)
    parallel: Any = None
    #: under ``--parallel`` (unless ``parallel_vae_decode=false``): every rank runs :meth:`decode`, decoding its
    #: round-robin share of each clip's VAE tiles; rank 0 stitches them and returns the outputs
    decode_on_every_rank: bool = False
    #: ``text_encoder_offload=cpu``: the text encoder lives in rank 0's host memory and encodes there
    #: (:func:`omnicore.plugin.shared_encode` gives every rank its rows); other ranks hold none (``None``)
    text_encoder_on_host: bool = False

    def enable_parallel(self, ctx: Any) -> None:
        """Run over a worker group. ``tp``: each DiT's attention and MLP linears are split over the TP ranks (a
        DiT loaded with ``tp=`` read only its shard). ``ulysses``: every request's document is padded to a
        multiple of the degree (pad rows are their own ``[pad]`` document, so no real row sees them) and each DiT
        runs its blocks on this rank's rows (of this rank's TP heads). ``cfg`` is refused: H3 is
        guidance-distilled (one forward per step, guidance_scale 1), so there is no second branch for a CFG rank
        to run. Under ``tp`` the Qwen3-VL text encoder's decoder is split over the same TP ranks (it too read only
        its shard); its vision tower and the VAEs stay replicated. A host-resident text encoder
        (``text_encoder_offload=cpu``) is never split: rank 0 holds it whole."""
        self.parallel = ctx
        if ctx is None:
            return
        if ctx.cfg > 1:
            raise ConfigError("parallel", f"cfg={ctx.cfg}: MiniMax-H3 is guidance-distilled (one DiT forward per "
                                          "step, no unconditional branch); use ulysses or tp")
        if getattr(ctx, "tp", 1) > 1:
            for dit in self.transformers.values():
                dit.enable_tensor_parallel(ctx)
            if self.text_encoder is not None and not self.text_encoder_on_host:
                self.text_encoder.enable_tensor_parallel(ctx)
        if ctx.ulysses > 1:
            import math

            self.seq_align = math.lcm(self.seq_align, ctx.ulysses)
            for dit in self.transformers.values():
                dit.enable_ulysses(ctx)

    def fast_path_gates(self) -> list[Any]:
        """The video VAE's request gate: the engine turns it on around ``quality="high"`` batches only."""
        return [fast_path_gate(self.video_vae)]

    @property
    def partition(self) -> str:
        """``"fl2va"``, ``"ref2va"`` or ``"combined"``."""
        parts = self.deployment.partitions
        return parts[0] if len(parts) == 1 else "combined"

    # ------------------------------------------------------------------------------------------ admission
    @staticmethod
    def _load_media(request: GenerationRequest) -> tuple[list[Any], list[MediaSummary]]:
        loaded, summaries = [], []
        for i, m in enumerate(request.inputs):
            try:
                data = m.load(field=f"inputs[{i}].data")
            except InvalidRequest:
                raise
            except Exception as exc:  # noqa: BLE001 - any decoder failure is the client's media
                raise InvalidRequest(f"inputs[{i}].data", f"cannot read the {m.kind}: {exc}") from None
            if m.kind == "image":
                data = to_rgb(data)
                summaries.append(MediaSummary(m.kind, m.role, size=data.size))
            elif m.kind == "video":
                summaries.append(MediaSummary(m.kind, m.role, size=(data.frames.shape[2], data.frames.shape[1]),
                                              duration_s=data.duration_s))
                data = VideoReference(data, _soundtrack(m.data, f"inputs[{i}].data"))
            else:
                summaries.append(MediaSummary(m.kind, m.role, duration_s=data.duration_s))
            loaded.append(data)
        return loaded, summaries

    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        """Apply every request rule once (task inference, canvas, frames, references), decode the media."""
        if request.prepared:
            return request
        check_extra(request.extra, self.spec)
        media, summaries = self._load_media(request)
        resolved = resolve_request(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                   params=request.params, extra=request.extra, media=summaries,
                                   deployment=self.deployment, default_steps=self.spec.defaults.num_inference_steps,
                                   default_frames=None if self.spec.defaults == DEFAULTS else
                                   self.spec.defaults.num_frames)
        seed = request.params.seed if request.params.seed is not None else 42
        params = request.params.with_defaults(
            self.spec.defaults, height=resolved.height, width=resolved.width, num_frames=resolved.num_frames,
            fps=FPS, num_inference_steps=resolved.steps, flow_shift=resolved.video_shift, guidance_scale=1.0,
            seed=seed, output_type="video")
        return request.evolve(params=params, prepared=True, plan=H3Plan(resolved, tuple(media)))

    def batch_key(self, request: GenerationRequest) -> Hashable:
        """Sizes, frame counts and tasks may differ inside a batch (each output is its own packed document);
        the DiT (partition), the step count and both shifts may not."""
        r = resolved_of(request)
        return ("minimax-h3", r.partition, r.steps, r.video_shift, r.audio_shift, request.quality)

    # ------------------------------------------------------------------------------------------ encode
    def _conditions(self, request: GenerationRequest) -> dict[str, Any]:
        """Per request (shared by its outputs): text rows and tags, conditioning latents, reference audio rows
        and the reference blocks of the layout."""
        plan = plan_of(request)
        r, media = plan.resolved, plan.media
        items: list[tuple[str, Any]] = []
        visual: list[torch.Tensor] = []
        ref_audio: list[torch.Tensor] = []
        blocks: list[packing.ReferenceBlock] = []
        if r.task == "fl2va":
            for k, (index, _anchor) in enumerate(r.keyframes):
                image = fit_keyframe(media[index], r.height, r.width, index=k)
                items.append((f"<Picture {k + 1}>: ", image))
                visual.append(self.video_vae.encode_condition(np.array(image)[None]))
        elif r.task == "ref2va":
            counts = {"image": 0, "audio": 0, "video": 0}
            for index in r.references:
                data = media[index]
                kind = request.inputs[index].kind
                if kind == "video":
                    self._video_reference(data, r, counts, items, visual, ref_audio, blocks)
                elif kind == "image":
                    counts["image"] += 1
                    image = fit_reference_image(data, self.reference_short_edge)
                    items.append((f"<Picture {counts['image']}>: ", image))
                    latents = self.video_vae.encode_condition(np.array(image)[None])
                    visual.append(latents)
                    blocks.append(packing.ReferenceBlock("image", _grid(latents)))
                else:
                    counts["audio"] += 1
                    items.append((f"<Audio {counts['audio']}>: ", None))
                    wave = stereo_at(data.waveform, int(data.sample_rate), self.audio_vae.sample_rate,
                                     r.num_frames / FPS)
                    rows = self.audio_vae.encode_rows(wave)
                    ref_audio.append(rows)
                    blocks.append(packing.ReferenceBlock("audio", None, rows.shape[0] // packing.AUDIO_CHANNELS))
        embeds, tags = self._encode_text(r.prompt, items)
        return {"embeds": embeds, "tags": tags, "visual": visual, "ref_audio": ref_audio, "blocks": blocks}

    def _encode_text(self, prompt: str, items: list[tuple[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditioner's rows and tags: from the resident encoder, or (``text_encoder_offload=cpu``) from the
        host's, run on rank 0 alone and shared with every rank (rows moved to the device, tags on the host)."""
        encoder = self.text_encoder
        if not self.text_encoder_on_host:
            assert encoder is not None
            return encoder.encode(prompt, items)
        compute = None if encoder is None else (lambda: encoder.encode(prompt, items))
        embeds, tags = shared_encode(self.parallel, compute, device=self.device)
        return embeds, tags.cpu()

    def _video_reference(self, ref: VideoReference, r: ResolvedRequest, counts: dict[str, int],
                         items: list[tuple[str, Any]], visual: list[torch.Tensor], ref_audio: list[torch.Tensor],
                         blocks: list[packing.ReferenceBlock]) -> None:
        """One ref2va video: its soundtrack rows first (labelled ``<Audio j>``), then its latents and its
        conditioner frames (``<Video k>`` with timestamped blocks)."""
        clip = ref.clip
        canvas = canvas_for_ratio(clip.frames.shape[2], clip.frames.shape[1],
                                  short_edge=self.deployment.canvas_short_edge,
                                  max_pixels=self.deployment.canvas_max_pixels,
                                  multiple=self.deployment.canvas_multiple, field="inputs")
        # only the source frames that reach the generated length: a lazily decoded upload decodes no more
        needed = int(np.ceil(r.num_frames * clip.fps / FPS)) + 1
        frames = video_at_24fps(clip.frames[:needed], clip.fps, r.num_frames, canvas)
        audio_latents = 0
        if ref.audio is not None:
            counts["audio"] += 1
            items.append((f"<Audio {counts['audio']}>: ", None))
            wave = stereo_at(ref.audio.waveform, int(ref.audio.sample_rate), self.audio_vae.sample_rate,
                             r.num_frames / FPS)
            rows = self.audio_vae.encode_rows(wave)
            ref_audio.append(rows)
            audio_latents = rows.shape[0] // packing.AUDIO_CHANNELS
        counts["video"] += 1
        sampled, stamps = conditioner_frames(frames)
        items.append((f"<Video {counts['video']}>: ", VideoCondition(sampled, stamps)))
        latents = self.video_vae.encode_condition(frames[:encodable_frames(frames.shape[0])])
        visual.append(latents)
        blocks.append(packing.ReferenceBlock("video", _grid(latents), audio_latents))

    def _layout(self, r: ResolvedRequest, cond: dict[str, Any], patch: tuple[int, int, int]) -> packing.Layout:
        lh, lw = r.height // self.video_vae.spatial_ratio, r.width // self.video_vae.spatial_ratio
        if r.task == "ref2va":
            return packing.reference_layout(cond["tags"], cond["blocks"], r.num_latent_frames, lh, lw,
                                            r.num_audio_latents, patch)
        return packing.keyframe_layout(cond["tags"], r.num_latent_frames, lh, lw, r.num_audio_latents,
                                       [a for _, a in r.keyframes], patch)

    def _noise_rows(self, r: ResolvedRequest, seed: int, cond: dict[str, Any], patch: tuple[int, int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Video and audio rows of one output: noised anchors then generated rows (see the module docstring)."""
        gen = torch.Generator("cpu").manual_seed(seed)
        aug = torch.tensor(CONDITION_VIDEO_T, dtype=torch.float32)
        anchors = []
        for latents in cond["visual"]:
            noise = torch.randn(latents.shape, generator=gen, dtype=torch.float32)
            anchors.append(packing.patchify(aug * latents + (1.0 - aug) * noise, patch))
        lh, lw = r.height // self.video_vae.spatial_ratio, r.width // self.video_vae.spatial_ratio
        video = torch.randn((1, self.video_vae.latent_channels, r.num_latent_frames, lh, lw), generator=gen,
                            dtype=torch.float32)
        audio = torch.randn((packing.AUDIO_CHANNELS * r.num_audio_latents, self.audio_vae.latent_channels),
                            generator=gen, dtype=torch.float32)
        video_rows = torch.cat(anchors + [packing.patchify(video, patch)])
        audio_rows = torch.cat(list(cond["ref_audio"]) + [audio])
        return video_rows, audio_rows

    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        from .transformer.layout import RequestLayout

        reqs = self.batch_requests(requests)
        first = resolved_of(reqs[0])
        dit = self.transformers[first.partition]
        materialize(dit)  # prepare_request runs DiT modules outside forward: load model-offloaded weights first
        patch = tuple(dit.config.patch_size)
        items: list[Item] = []
        plans, video, audio = [], [], []
        for ri, request in enumerate(reqs):
            r = resolved_of(request)
            cond = self._conditions(request)
            lay = self._layout(r, cond, patch)
            try:
                layout = RequestLayout.build(lay.position_ids, lay.token_tags, lay.video_indices, lay.audio_indices,
                                             lay.text_indices, lay.num_condition_video_rows,
                                             lay.num_condition_audio_rows, seq_align=self.seq_align,
                                             pad_seq_len=r.pad_seq_len)
            except ValueError as exc:
                raise InvalidRequest("extra.pad_seq_len", str(exc)) from None
            if layout.seq_len % self.seq_align and self.parallel is not None:
                raise InvalidRequest("extra.pad_seq_len", f"{layout.seq_len} rows cannot be split over "
                                                          f"ulysses={self.parallel.ulysses} ranks: use a multiple")
            lh, lw = r.height // self.video_vae.spatial_ratio, r.width // self.video_vae.spatial_ratio
            layout = layout.with_latent_grid((r.num_latent_frames // patch[0], lh // patch[1], lw // patch[2]))
            with lora_sample_rows([len(items)]):  # the refiner's rows are this request's (its first output's LoRA)
                plan = dit.prepare_request(layout, cond["embeds"])
            first_seed = output_seeds(request)[0]  # the engine set it; a missing seed is an error naming the request
            for oi in range(r.num_outputs):
                seed = first_seed + oi
                v, a = self._noise_rows(r, seed, cond, patch)
                items.append(Item(ri, oi, seed, r, layout, v.shape[0], a.shape[0]))
                plans.append(plan)
                video.append(v)
                audio.append(a)
        sig_v, sig_a = paired_sigmas(first.steps + 1, first.video_shift, first.audio_shift)
        extras: dict[str, Any] = {"items": items, "partition": first.partition, "sigmas": (sig_v, sig_a),
                                  "t": (timesteps(sig_v), timesteps(sig_a))}
        self._set_batch(extras, dit, plans)
        # the whole schedule's time embeddings at once (bitwise what each forward would compute)
        extras["t_embs"] = dit.schedule_embeddings([s.unique_timesteps for s in extras["steps"]])
        latents = (torch.cat(video).to(self.device), torch.cat(audio).to(self.device))
        return DenoiseState(requests=reqs, num_steps=int(sig_v.numel()) - 1, latents=latents,
                            timesteps=extras["t"][0], extras=extras)

    def _set_batch(self, extras: dict[str, Any], dit: Any, plans: Sequence[Any]) -> None:
        """(Re)build the packed batch, its per-step timestep tables and the generated-row indices."""
        items: list[Item] = extras["items"]
        batch = dit.pack(plans)
        t_v, t_a = extras["t"]
        n = len(items)
        steps = [batch.step_timesteps([float(t_v[s])] * n, [float(t_a[s])] * n, CONDITION_VIDEO_T,
                                      CONDITION_AUDIO_T) for s in range(t_v.numel())]
        vt, at, vo, ao = [], [], 0, 0
        for it in items:
            vt.append(torch.arange(vo + it.layout.num_condition_video_rows, vo + it.video_rows))
            at.append(torch.arange(ao + it.layout.num_condition_audio_rows, ao + it.audio_rows))
            vo, ao = vo + it.video_rows, ao + it.audio_rows
        extras.update(batch=batch, plans=list(plans), steps=steps, adaln_key=schedule_key(steps),
                      video_target=torch.cat(vt).to(self.device), audio_target=torch.cat(at).to(self.device))
        extras.pop("adaln_schedule", None)  # a new batch composition may have new unique timesteps: re-prepare
        extras.pop("t_embs", None)  # likewise the precomputed time embeddings (forwards compute their own)

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None:
        """Drop cancelled requests: keep their outputs' rows and plans, re-pack the survivors."""
        keep = list(keep)
        if not keep:
            return None
        ex = state.extras
        items: list[Item] = ex["items"]
        video_parts = list(state.latents[0].split([it.video_rows for it in items]))
        audio_parts = list(state.latents[1].split([it.audio_rows for it in items]))
        chosen = [i for i, it in enumerate(items) if it.request_index in keep]
        residual = ex.pop(BLOCK_RESIDUAL, None)
        if residual is not None:  # TeaCache's kept residual: the survivors' packed rows, in their new order
            offsets = ex["batch"].offsets
            ex[BLOCK_RESIDUAL] = torch.cat([residual[offsets[i]:offsets[i + 1]] for i in chosen])
        remap = {old: new for new, old in enumerate(keep)}
        ex["items"] = [attrs.evolve(items[i], request_index=remap[items[i].request_index]) for i in chosen]
        plans = [ex["plans"][i] for i in chosen]
        state.requests = [state.requests[i] for i in keep]
        state.latents = (torch.cat([video_parts[i] for i in chosen]), torch.cat([audio_parts[i] for i in chosen]))
        self._set_batch(ex, self.transformers[ex["partition"]], plans)
        return state

    # ------------------------------------------------------------------------------------------ step checkpoints
    def export_step_state(self, state: DenoiseState, row: int) -> dict[str, Any]:
        """Request ``row``'s step state: the packed video and audio rows of its outputs (anchors included). Euler
        with eta 0 keeps no history and draws no noise after ``encode``; TeaCache's kept residual is a cache's
        memory and restarts cold."""
        items: list[Item] = state.extras["items"]
        video_parts = state.latents[0].split([it.video_rows for it in items])
        audio_parts = state.latents[1].split([it.audio_rows for it in items])
        mine = [i for i, it in enumerate(items) if it.request_index == row]
        return {"video": torch.cat([video_parts[i] for i in mine]), "audio": torch.cat([audio_parts[i] for i in mine])}

    def import_step_state(self, state: DenoiseState, saved: dict[str, Any]) -> DenoiseState:
        """Put an exported step state into a fresh ``encode`` of its request (alone: the same rows, in order)."""
        video, audio = state.latents
        if saved["video"].shape != video.shape or saved["audio"].shape != audio.shape:
            raise ValueError(f"step checkpoint rows {tuple(saved['video'].shape)}/{tuple(saved['audio'].shape)} do "
                             f"not match the request's {tuple(video.shape)}/{tuple(audio.shape)}")
        state.latents = (saved["video"].to(video.device, video.dtype), saved["audio"].to(audio.device, audio.dtype))
        return state

    # ------------------------------------------------------------------------------------------ denoise
    def dit_for(self, state: DenoiseState) -> Any:
        return self.transformers[state.extras["partition"]]

    @staticmethod
    def _step_kwargs(state: DenoiseState, step: int) -> dict[str, Any]:
        """How a forward at ``step`` gets its time embedding: the prepared AdaLN schedule's step (the
        adaln_schedule method prepared this batch's DiT, with its own tables), else the precomputed one."""
        ex = state.extras
        if STATE_STEP_KEY in ex:
            return {"adaln_step_index": step}
        return {"time_embedding": ex["t_embs"][step]} if "t_embs" in ex else {}

    @torch.no_grad()
    def predict(self, state: DenoiseState, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity rows ``(video, audio)`` of every output in the batch: one DiT forward. When TeaCache asked
        for it (``KEEP_RESIDUAL``), the forward also keeps its blocks' residual for the next reuse."""
        ex = state.extras
        ts = ex["steps"][step]
        dit = self.dit_for(state)
        keep: dict[str, torch.Tensor] | None = {} if ex.pop(KEEP_RESIDUAL, False) else None
        video, audio = state.latents
        v, a = dit(ex["batch"], video, audio, ts.unique_timesteps, ts.inverse_indices, residual_out=keep,
                   **self._step_kwargs(state, step))
        if keep is not None:
            ex[BLOCK_RESIDUAL] = keep["block_residual"]
        return v.float(), a.float()

    @torch.no_grad()
    def predict_from_block_residual(self, state: DenoiseState, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """TeaCache's reuse (the reference's rule): this step's embedded input plus the residual the blocks added
        at the last computed step, through the final layer at this step's timesteps; the blocks do not run."""
        ex = state.extras
        residual = ex.get(BLOCK_RESIDUAL)
        if residual is None:
            raise RuntimeError("TeaCache reuse without a kept block residual (no computed step kept one)")
        ts = ex["steps"][step]
        video, audio = state.latents
        v, a = self.dit_for(state)(ex["batch"], video, audio, ts.unique_timesteps, ts.inverse_indices,
                                   block_residual=residual, **self._step_kwargs(state, step))
        return v.float(), a.float()

    @torch.no_grad()
    def update(self, state: DenoiseState, step: int, prediction: Any) -> DenoiseState:
        """Euler on the generated rows only; conditioning / reference rows keep their anchors."""
        ex = state.extras
        (sig_v, sig_a), (t_v, t_a) = ex["sigmas"], ex["t"]
        v, a = prediction
        video, audio = state.latents
        vi, ai = ex["video_target"], ex["audio_target"]
        new_v = euler_step(video.index_select(0, vi), v.index_select(0, vi), t_v[step], sig_v[step], sig_v[step + 1])
        new_a = euler_step(audio.index_select(0, ai), a.index_select(0, ai), t_a[step], sig_a[step], sig_a[step + 1])
        state.latents = (video.index_copy(0, vi, new_v), audio.index_copy(0, ai, new_a))
        state.step_index = step + 1
        return state

    # ------------------------------------------------------------------------------------------ caches
    def adaln_schedule_plan(self, state: DenoiseState) -> tuple[list[torch.Tensor], Any]:
        """The batch's per-step distinct timesteps (known before the loop), tagged with the partition whose DiT
        runs them, and their exact-bits key."""
        from .adaln_routing import PartitionPlan

        steps = state.extras["steps"]
        return PartitionPlan([s.unique_timesteps for s in steps], state.extras["partition"]), state.extras["adaln_key"]

    @property
    def adaln_schedule(self) -> Any:
        """The AdaLN controller of the deployment: the DiT's own, or on a combined deployment one that sends each
        batch's schedule to its partition's DiT (:mod:`omni_minimax_h3.adaln_routing`), so each DiT keeps its own
        tables and alternating tasks do not rebuild each other's."""
        if self._adaln_router is not None:
            return self._adaln_router
        return next(iter(self.transformers.values())).adaln

    @property
    def block_loop(self) -> Any:
        """The blocks layer-wise offload streams (a combined deployment's FL2VA DiT; its Ref2VA DiT stays resident)."""
        from omnicore.plugin import BlockLoop

        name = "transformer" if self.transformer is not None else "transformer_ref"
        return BlockLoop(blocks=f"{name}.blocks", streams=("x",))

    @property
    def compile_regions(self) -> tuple[str, ...]:
        """Block lists compiled by ``--compile``: every served DiT's (a combined deployment has two)."""
        return tuple(f"transformers.{p}.blocks" for p in self.transformers)

    @property
    def offload_modules(self) -> dict[str, Any]:
        """Modules entered through ``forward`` (the DiTs; the text encoder is entered through ``encode``)."""
        return {f"transformer_{p}": m for p, m in self.transformers.items()}

    @property
    def teacache_adapter(self) -> Any:
        """TeaCache with the FL2VA calibration (threshold 0.17); refused for a Ref2VA-only deployment."""
        from .teacache import make_adapter

        return lambda: make_adapter(self)

    # ------------------------------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Output]:
        """One output per request output, in request order: uint8 frames at 24 fps + 32 kHz stereo audio.

        The video and the audio VAE are independent, so the soundtrack decodes on a helper thread while the frames
        decode here (torch releases the GIL inside ops: on a multi-core host the two overlap)."""
        from concurrent.futures import ThreadPoolExecutor

        ex = state.extras
        items: list[Item] = ex["items"]
        patch = tuple(self.transformers[ex["partition"]].config.patch_size)
        video_parts = state.latents[0].split([it.video_rows for it in items])
        audio_parts = state.latents[1].split([it.audio_rows for it in items])
        order = sorted(range(len(items)), key=lambda i: (items[i].request_index, items[i].output_index))
        tiles_over = self.parallel if self.decode_on_every_rank else None  # parallel VAE decode (tiles per rank)

        def frames_of(i: int) -> torch.Tensor:
            it, r = items[i], items[i].resolved
            lh, lw = r.height // self.video_vae.spatial_ratio, r.width // self.video_vae.spatial_ratio
            target = video_parts[i][it.layout.num_condition_video_rows:].cpu()
            return self.video_vae.decode(packing.unpatchify(target, self.video_vae.latent_channels,
                                                            r.num_latent_frames, lh, lw, patch), parallel=tiles_over)

        if tiles_over is not None and not tiles_over.is_driver:  # a worker: its share of the tiles, no outputs
            for i in order:
                frames_of(i)
            return []

        def audio_of(i: int) -> np.ndarray:
            with torch.no_grad():
                it = items[i]
                rows = audio_parts[i][it.layout.num_condition_audio_rows:].cpu()
                latents = packing.audio_rows_to_latents(rows, it.resolved.num_audio_latents)
                return self.audio_vae.decode(latents).cpu().numpy().astype(np.float32)

        outputs = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3-audio-decode") as pool:
            waves = [pool.submit(audio_of, i) for i in order]
            for i, wave in zip(order, waves):
                it = items[i]
                frames = frames_of(i)
                pixels = (frames * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
                request = state.requests[it.request_index]
                outputs.append(Output(kind="video", frames=pixels, fps=FPS, audio=wave.result(),
                                      sample_rate=SAMPLE_RATE, request_id=request.request_id, index=it.output_index,
                                      seed=it.seed))
        return outputs
