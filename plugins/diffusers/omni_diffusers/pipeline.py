"""``DiffusersPipeline``: any stock diffusers ``DiffusionPipeline`` behind omnicore's pipeline protocol.

The adapter never re-implements a model: each batch is **one call of the diffusers pipeline itself** (lists of
prompts, one ``torch.Generator`` per output row), so an output equals what that pipeline returns for the same
generator, and a batched row equals the request run alone (diffusers draws each row's noise from its own
generator). The call runs on a worker thread parked at step boundaries (:mod:`omni_diffusers.stepper`), so the
engine still sees ``encode`` / one ``denoise_step`` per step / ``decode``: progress per step, cancellation
between steps, step timings in the outputs' metrics.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.plugin import (
    BasePipeline,
    BlockLoop,
    DenoiseState,
    GenerationRequest,
    InvalidRequest,
    LoadOptions,
    LoRA,
    ModelSpec,
    Output,
    UnsupportedFeature,
    check_request,
    load_media,
    output_seeds,
)

from .attention import AttentionRoute, route_pipeline_attention
from .lora import DiffusersAdapters
from .modular import is_modular, load_modular, output_name, steps_planned
from .modular_driver import ModularRun, NotSteppable
from .signature import PipelineCard, describe
from .stepper import SteppedCall

DENOISERS = ("transformer", "transformer_2", "unet", "prior")
JSON_SCALARS = (str, int, float, bool, type(None))


def _frozen(value: Any, field: str) -> Hashable:
    """A hashable form of a JSON value (for the batch key); rejects what a JSON request cannot carry."""
    if isinstance(value, JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, field) for v in value)
    raise InvalidRequest(field, f"must be a JSON scalar or list, got {type(value).__name__}")


class DiffusersPipeline(BasePipeline):
    """Serves one loaded ``DiffusionPipeline``; ``spec`` is the registered spec narrowed to the pipeline's card."""

    def __init__(self, pipe: Any, device: torch.device) -> None:
        self.pipe, self.device = pipe, device
        self._registered: ModelSpec | None = None
        self._active: SteppedCall | None = None
        self.modular = is_modular(pipe)  # no callback_on_step_end: the engine drives its loop (modular_driver)
        self.driven = self.modular  # False once its blocks proved not splittable at the loop (threaded call then)
        params = describe_params(pipe)
        if not self.modular and "callback_on_step_end" not in params:
            raise UnsupportedFeature("diffusers", f"{type(pipe).__name__}.__call__ takes no callback_on_step_end, "
                                                  "so it cannot be stepped, cancelled or report progress")
        self.denoisers = [getattr(pipe, n) for n in DENOISERS if isinstance(getattr(pipe, n, None), torch.nn.Module)]
        if not self.denoisers:
            raise UnsupportedFeature("diffusers", f"{type(pipe).__name__} has none of the denoisers {DENOISERS}")
        # the engine's --offload model: every component entered through forward (VAEs are entered through decode)
        self.offload_modules = {n: m for n, m in pipe.components.items()
                                if isinstance(m, torch.nn.Module) and not n.startswith("vae")}
        # the engine's --offload layerwise (and --compile's regions): every block list of every denoiser, in the
        # order their forward runs them (FLUX: transformer_blocks, then single_transformer_blocks)
        self.offload_blocks = denoiser_blocks(self.denoisers)
        self.block_loop = BlockLoop(blocks="offload_blocks") if self.offload_blocks else None
        self.card: PipelineCard | None = None
        self.adapters = DiffusersAdapters(pipe)  # LoRA through diffusers' own loader, one adapter set per call
        self.cache_decisions: list[bool] | None = None  # set by omni_diffusers.caching while a cache is enabled
        self.uncounted_cache = False  # a diffusers hook cache is on whose reused steps omnicore cannot count
        self.attention = AttentionRoute()  # set by from_pretrained: which attention runs omnicore's backends

    # ------------------------------------------------------------------ loading and the spec
    @classmethod
    def from_pretrained(cls, path: Path, options: LoadOptions) -> DiffusersPipeline:
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
        if (Path(path) / "modular_model_index.json").is_file() and not (Path(path) / "model_index.json").is_file():
            pipe = load_modular(Path(path), options.dtype, options.platform.device())
        else:
            kwargs = {"dtype": options.dtype} if options.dtype is not None else {}
            pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), **kwargs).to(options.platform.device())
            pipe.set_progress_bar_config(disable=True)
        loaded = cls(pipe, options.platform.device())
        vaes = [m for n, m in pipe.components.items() if n.startswith("vae") and isinstance(m, torch.nn.Module)]
        loaded.attention = route_pipeline_attention(loaded.denoisers, vaes, options)
        return loaded

    @property
    def spec(self) -> ModelSpec:
        if self._registered is None:
            raise AttributeError("spec")
        return self._spec

    @spec.setter
    def spec(self, registered: ModelSpec) -> None:
        """The engine sets the registered spec (with a preset's defaults); the card narrows it to this pipeline."""
        from .plugin import MODEL_SPEC

        self._registered = registered
        own_defaults = registered.defaults != MODEL_SPEC.defaults  # a preset's defaults win over the signature's
        self.card = describe(self.pipe, registered.capabilities, registered.defaults)
        defaults = registered.defaults if own_defaults else self.card.defaults
        # --attention-backend reaches this pipeline only where its denoisers' attention was routed (.attention)
        capabilities = attrs.evolve(self.card.capabilities,
                                    honours_attention_backend=self.attention.honours_backend)
        self._spec = attrs.evolve(registered, capabilities=capabilities, defaults=defaults,
                                  aliases=(*registered.aliases, self.card.class_name.lower()),
                                  request_fields=self.card.request_fields,
                                  description=f"{self.card.class_name} through diffusers{self._attention_note()} "
                                              f"({registered.description})")

    def _attention_note(self) -> str:
        """Why a loaded pipeline does not honour ``--attention-backend`` (its unrouted processors), else empty."""
        unrouted = self.attention.unrouted or (() if self.attention.routed else ("no attention module",))
        return f"; its attention stays diffusers' ({', '.join(unrouted)} not routable)" if unrouted else ""

    # ------------------------------------------------------------------ requests
    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        card = self._card()
        request = check_request(request, self.spec)  # roles filled and checked also when called without the engine
        params = request.params.with_defaults(self.spec.defaults)
        multiple = card.capabilities.size_multiple_of or 1
        for name in ("height", "width"):
            if getattr(params, name) % multiple:
                raise InvalidRequest(f"params.{name}", f"must be a multiple of {multiple} for {card.class_name}")
        if not card.video and params.num_frames != 1:
            raise InvalidRequest("params.num_frames", f"{card.class_name} makes images: num_frames must be 1")
        if card.frame_multiple and params.num_frames is not None and (params.num_frames - 1) % card.frame_multiple:
            raise InvalidRequest("params.num_frames", f"must be {card.frame_multiple}n+1 for {card.class_name}")
        guidance = params.guidance_scale  # 0 is legitimate (distilled / turbo pipelines run without guidance)
        if "guidance_scale" in card.parameters and not (isinstance(guidance, (int, float))
                                                         and math.isfinite(guidance) and guidance >= 0):
            raise InvalidRequest("params.guidance_scale", "must be a finite number >= 0")
        if params.flow_shift is not None:
            raise InvalidRequest("params.flow_shift", "diffusers pipelines take their shift from the scheduler "
                                                      "config; flow_shift is not supported")
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise InvalidRequest("prompt", "must be a non-empty string")
        unknown = sorted(k for k in request.extra if k not in card.extra_keys)
        if unknown:
            raise InvalidRequest(f"extra.{unknown[0]}", f"{', '.join(unknown)}: not keyword argument(s) of "
                                 f"{card.class_name}.__call__ that a request may set; accepted: "
                                 f"{', '.join(card.extra_keys) or 'none'}")
        for key, value in request.extra.items():
            _frozen(value, f"extra.{key}")
        roles = {m.role for m in request.inputs}
        if card.conditioned and not roles & set(card.roles):
            need = " + ".join(card.roles)
            raise InvalidRequest("inputs", f"{card.class_name} needs an input image ({need})")
        if ("mask" in roles) != ("edit_source" in roles) and "mask" in card.roles:
            raise InvalidRequest("inputs", f"{card.class_name} needs both an edit_source image and a mask")
        negative = request.negative_prompt or self.spec.defaults.negative_prompt or None
        return request.evolve(params=params, negative_prompt=negative, prepared=True)

    def batch_key(self, request: GenerationRequest) -> Hashable:
        extra = tuple(sorted((k, _frozen(v, k)) for k, v in request.extra.items()))
        # conditioned requests share a call only where diffusers reads an image list as one image per prompt
        alone = request.request_id if request.inputs and not self._card().batches_media else None
        fps = request.params.fps if self._card().fps_keyword is not None else None  # one frame rate per call
        return (request.batch_key(), extra, request.negative_prompt is not None, alone, self.adapters.key(request),
                fps)

    def check_loras(self, loras: Sequence[LoRA], registry: Any) -> None:
        """The engine's seam for a pipeline that applies adapters itself: read and check ``loras`` (at submit, and
        the server's preloaded ones at start-up) — ``LoRAError`` naming the adapter and the key."""
        self.adapters.check(loras, registry)

    def _card(self) -> PipelineCard:
        if self.card is None:
            raise RuntimeError("the pipeline has no spec yet (the engine sets it after loading)")
        return self.card

    def call_kwargs(self, requests: Sequence[GenerationRequest]) -> dict[str, Any]:
        """The keyword arguments of the one diffusers call serving ``requests`` (one row per output)."""
        card, p = self._card(), requests[0].params
        rows = [(r, seed) for r in requests for seed in output_seeds(r)]
        kw: dict[str, Any] = {"prompt": [r.prompt for r, _ in rows], "height": p.height, "width": p.width,
                              "generator": [torch.Generator().manual_seed(s) for _, s in rows]}
        if requests[0].negative_prompt is not None and "negative_prompt" in card.parameters:
            kw["negative_prompt"] = [r.negative_prompt for r, _ in rows]
        kw["num_inference_steps"] = p.num_inference_steps
        if "guidance_scale" in card.parameters:
            kw["guidance_scale"] = p.guidance_scale
        if card.video:
            kw["num_frames"] = p.num_frames
        kw["output_type"] = "np"
        if self.modular:  # the state key the decode block writes
            kw["output"] = output_name(card.video)
        if "max_sequence_length" in card.parameters and "max_sequence_length" not in requests[0].extra:
            limit = self._tokenizer_limit(card)
            if limit is not None:
                kw["max_sequence_length"] = limit
        for role, keyword in card.roles.items():
            loaded = {}
            for r in requests:
                media = [m for m in r.inputs if m.role == role]
                if media:
                    loaded[r.request_id] = load_media(media[0].kind, media[0].data, field=f"inputs.{role}")
            if loaded:  # equal batch keys: every request of the batch has this role
                per_row = [loaded[r.request_id] for r, _ in rows]
                kw[keyword] = per_row[0] if len(per_row) == 1 else per_row
        kw.update(requests[0].extra)
        if card.fps_keyword is not None and card.fps_keyword not in kw and p.fps is not None:
            kw[card.fps_keyword] = self._frame_rate(card.fps_keyword, p.fps)
        return kw

    def _frame_rate(self, keyword: str, fps: float) -> float | int:
        """``fps`` in the type of the pipeline's own default (LTX's ``frame_rate`` is an int)."""
        default = describe_params(self.pipe)[keyword].default
        return int(fps) if isinstance(default, int) and float(fps).is_integer() else fps

    def output_fps(self, request: GenerationRequest) -> float | None:
        """The frame rate a video is written at: what the pipeline was told (``extra`` ``frame_rate`` / ``fps``, or
        the request's fps passed there), else the request's fps."""
        keyword = self._card().fps_keyword
        told = request.extra.get(keyword) if keyword is not None else None
        return float(told) if isinstance(told, (int, float)) and not isinstance(told, bool) else request.params.fps

    def _tokenizer_limit(self, card: PipelineCard) -> int | None:
        """``max_sequence_length`` capped at the longest tokenizer's ``model_max_length`` (the signature's default
        is meant for the real text encoder; a checkpoint whose tokenizers are shorter would otherwise fail)."""
        default = describe_params(self.pipe)["max_sequence_length"].default
        lengths: list[int] = [t.model_max_length for n, t in self.pipe.components.items()
                              if n.startswith("tokenizer") and isinstance(getattr(t, "model_max_length", None), int)]
        if not lengths or not isinstance(default, int):
            return None
        return min(default, max(lengths))

    # ------------------------------------------------------------------ the stepped call
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        requests = self.batch_requests(requests)
        if self._active is not None:  # a batch the engine dropped (cancelled, failed): leave its call first
            self._active.abort()
        self.adapters.activate(requests)  # the batch's adapter set (or none) before the call
        for model in self.denoisers:  # a call left by abort never reached diffusers' own reset of its cache
            if getattr(model, "is_cache_enabled", False):
                model._reset_stateful_cache()
        if self.modular and self.driven:
            state = self._start_driven(requests)
            if state is not None:
                return state
        if self.modular:
            scheduler = self.pipe.scheduler
            call = SteppedCall(self.pipe.__call__, self.call_kwargs(requests), self.denoisers,
                               lambda: steps_planned(scheduler), scheduler=scheduler)
        else:
            call = SteppedCall(self.pipe.__call__, self.call_kwargs(requests), self.denoisers,
                               lambda: getattr(self.pipe, "_num_timesteps", None))
        self._active = call
        steps = call.start()
        if steps is None:  # the call ended before its denoiser ran (zero steps, e.g. strength 0)
            steps = 0
        state = DenoiseState(requests=list(requests), num_steps=int(steps), extras={"call": call},
                             reused_steps=None if self.uncounted_cache else [])
        weakref.finalize(state, call.abort, False)  # a state the engine drops mid-run stops its call
        return state

    def _start_driven(self, requests: list[GenerationRequest]) -> DenoiseState | None:
        """A modular batch split at its denoise loop (:mod:`omni_diffusers.modular_driver`); ``None`` when the
        pipeline's blocks cannot be split (then, and for every later batch, the threaded call serves it)."""
        kwargs = self.call_kwargs(requests)
        run = ModularRun(self.pipe, kwargs, kwargs.pop("output"))
        try:
            steps = run.start(rows=len(kwargs["prompt"]))
        except NotSteppable as exc:
            self.driven = False
            warnings.warn(f"{type(self.pipe).__name__}: the engine cannot drive the denoise loop step by step "
                          f"({exc}); each batch runs as one call parked after each scheduler step instead",
                          stacklevel=2)
            return None
        return DenoiseState(requests=list(requests), num_steps=steps, extras={"run": run},
                            reused_steps=None if self.uncounted_cache else [])

    def denoise_step(self, state: DenoiseState, step: int) -> DenoiseState:
        decisions = self.cache_decisions
        if decisions is not None:
            decisions.clear()
        if "run" in state.extras:
            state.extras["run"].step(step)
        else:
            state.extras["call"].step(step)
        if decisions and not any(decisions) and state.reused_steps is not None:  # every call skipped the rest
            state.reused_steps.append(step)
        return state

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState | None:
        """Drop cancelled requests from a driven modular batch (their rows leave the latents, the embeddings and
        the scheduler's history); a stock pipeline's call cannot shrink (``None``: its rows run to the end)."""
        run: ModularRun | None = state.extras.get("run")
        if run is None:
            return None
        starts = np.cumsum([0] + [r.params.num_outputs for r in state.requests])
        run.select([row for i in keep for row in range(int(starts[i]), int(starts[i + 1]))])
        state.requests = [state.requests[i] for i in keep]
        for model in self.denoisers:  # a hook cache's kept residuals still have the old rows: recompute once
            if getattr(model, "is_cache_enabled", False):
                model._reset_stateful_cache()
        return state

    def decode(self, state: DenoiseState) -> list[Output]:
        stepped: ModularRun | SteppedCall = state.extras["run"] if "run" in state.extras else state.extras["call"]
        result = stepped.finish()
        self._active = None
        card = self._card()
        metrics = {"step_times_s": list(stepped.step_times), "diffusers_pipeline": card.class_name}
        if self.modular:  # the decode block's output itself (output_type "np")
            result = attrs.evolve(_Frames(result), video=card.video)
        if card.video:
            from .audio import audio_rows, sample_rate

            rows = [to_uint8(np.asarray(f)) for f in result.frames]
            sounds = audio_rows(result, len(rows)) if "audio" in card.capabilities.outputs else [None] * len(rows)
            rate = sample_rate(self.pipe) if any(a is not None for a in sounds) else None
            if rate is None and any(a is not None for a in sounds):
                warnings.warn(f"{card.class_name} returned audio but no sample rate omnicore knows where to find "
                              f"(omni_diffusers.audio.RATE_ATTRIBUTES); the videos are written without sound",
                              stacklevel=1)
            fps = self.output_fps(state.requests[0])
            return [Output(kind="video", frames=f, fps=fps, metrics=dict(metrics),
                           audio=a if rate else None, sample_rate=rate if a is not None else None)
                    for f, a in zip(rows, sounds, strict=True)]
        images = to_uint8(np.asarray(result.images))
        return [Output(kind="image", frames=img[None], metrics=dict(metrics)) for img in images]


def denoiser_blocks(denoisers: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The blocks of each denoiser's ``nn.ModuleList`` children named ``*blocks`` (diffusers' convention:
    ``transformer_blocks``, ``single_transformer_blocks``, ``blocks``, a UNet's ``down_blocks`` / ``up_blocks``),
    in definition order; the parameters outside them stay on the device."""
    found: list[torch.nn.Module] = []
    for model in denoisers:
        for name, child in model.named_children():
            if name.endswith("blocks") and isinstance(child, torch.nn.ModuleList):
                found.extend(child)
    return found


def describe_params(pipe: Any) -> dict[str, Any]:
    """``__call__``'s parameters (a modular pipeline's: its blocks' inputs)."""
    from .signature import call_parameters

    return call_parameters(pipe)


@attrs.frozen
class _Frames:
    """A modular pipeline's decoded array in the shape of a stock pipeline's output (``images`` / ``frames``)."""

    value: Any
    video: bool = False

    @property
    def images(self) -> Any:
        return self.value

    @property
    def frames(self) -> Any:
        return self.value


def to_uint8(array: np.ndarray) -> np.ndarray:
    """diffusers' own float -> uint8 conversion (``numpy_to_pil``): ``round(x * 255)``, so bytes match its PIL."""
    return (array * 255).round().astype("uint8")
