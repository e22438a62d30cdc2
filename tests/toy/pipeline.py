"""``ToyPipeline``: the test-only pipeline (flow-matching Euler sampler over :class:`ToyDenoiser`).

Supports batching, text-to-image (``num_frames == 1``) and short video (``num_frames > 1``, returns fps),
classifier-free guidance when ``guidance_scale > 1``, partial-batch shrinking on cancellation, and reference
images up to the spec's ``max_reference_images`` (loaded in preprocess; their brightness shifts the conditioning).
Model-specific ``extra`` fields: ``tag`` (str, only changes the batch key), ``fail_at`` (one of
``preprocess``, ``encode``, ``denoise``, ``decode``: raise there, to test failure handling) and ``size``
(``"WxH"``, overrides width/height: a model-specific way to name the size, as real models have).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.engine.cancellation import cancel_points
from omnicore.engine.protocol import BasePipeline, DenoiseState, LoadOptions, output_seeds
from omnicore.engine.request import GenerationRequest
from omnicore.errors import InvalidRequest
from omnicore.outputs.output import Output
from safetensors.torch import load_file, save_file

from .model import ToyConfig, ToyDenoiser

EXTRA_FIELDS = ("tag", "fail_at", "size")
FAIL_POINTS = ("preprocess", "encode", "denoise", "decode")


class ToyFailure(RuntimeError):
    """Raised on purpose when a request asks for ``extra={"fail_at": ...}``."""


def build_toy_checkpoint(target: str | Path, config: ToyConfig | None = None, *, weight_seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (deterministic random weights) into ``target``."""
    cfg = config or ToyConfig()
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(weight_seed)
        model = ToyDenoiser(cfg)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
    return target


def build_tiny(target: str | Path) -> None:
    """The ``tiny:toy`` preset builder (the loader calls it with a fresh temporary directory)."""
    build_toy_checkpoint(target)


def detect(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type") == "omnicore-toy"
    except (OSError, ValueError):
        return False


def _fail(request: GenerationRequest, point: str) -> None:
    if request.extra.get("fail_at") == point:
        raise ToyFailure(f"request {request.request_id} asked to fail at {point}")


class ToyPipeline(BasePipeline):
    """Loaded toy model. ``preprocess_calls`` counts preprocess per request id (tests assert "exactly once")."""

    def __init__(self, model: ToyDenoiser, options: LoadOptions | None = None) -> None:
        from .plugin import TOY_SPEC

        self.spec = TOY_SPEC  # the loader replaces it with the registered record (which names its provider)
        self.model = model.eval()
        self.options = options
        self.preprocess_calls: dict[str, int] = {}
        self.preprocess_threads: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: Path, options: LoadOptions) -> ToyPipeline:
        path = Path(path)
        cfg = ToyConfig.from_json(json.loads((path / "config.json").read_text()))
        model = ToyDenoiser(cfg)
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        return cls(model, options)

    # ------------------------------------------------------------------ admission
    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        with self._lock:
            self.preprocess_calls[request.request_id] = self.preprocess_calls.get(request.request_id, 0) + 1
            self.preprocess_threads[request.request_id] = threading.get_ident()
        for key, value in request.extra.items():
            if key not in EXTRA_FIELDS:
                raise InvalidRequest(f"extra.{key}", f"is not a field of model 'toy' (known: {list(EXTRA_FIELDS)})")
            if key == "tag" and not isinstance(value, str):
                raise InvalidRequest("extra.tag", f"must be a string, got {value!r}")
            if key == "fail_at" and value not in FAIL_POINTS:
                raise InvalidRequest("extra.fail_at", f"must be one of {list(FAIL_POINTS)}, got {value!r}")
        _fail(request, "preprocess")
        defaults = self.spec.defaults
        params = request.params.with_defaults(defaults)
        if "size" in request.extra:  # a model-specific way to give the size (overrides width/height)
            try:
                w, h = (int(v) for v in str(request.extra["size"]).lower().split("x"))
            except ValueError:
                raise InvalidRequest("extra.size", f"must be 'WxH', got {request.extra['size']!r}") from None
            params = attrs.evolve(params, width=w, height=h)
        scale = self.model.cfg.vae_scale
        for name in ("height", "width"):
            if getattr(params, name) % scale:
                raise InvalidRequest(f"params.{name}", f"must be a multiple of {scale} for model 'toy'")
        if params.output_type == "image" and params.num_frames != 1:
            raise InvalidRequest("params.num_frames", "must be 1 when output_type is 'image'")
        limit = self.spec.capabilities.max_outputs_per_request
        if params.num_outputs > limit:
            raise InvalidRequest("params.num_outputs", f"must be <= {limit} for model 'toy'")
        negative = request.negative_prompt if request.negative_prompt is not None else defaults.negative_prompt
        return request.evolve(params=params, negative_prompt=negative, images=self._load_images(request.images),
                              prepared=True)

    def _load_images(self, images: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
        """Reference images (paths, bytes, PIL images or uint8 arrays) -> uint8 ``[H, W, 3]`` arrays."""
        from omnicore.outputs.readers import read_image

        limit = self.spec.capabilities.max_reference_images
        if len(images) > limit:
            raise InvalidRequest("images", f"model {self.spec.name!r} takes at most {limit} reference images, "
                                           f"got {len(images)}")
        loaded = []
        for i, image in enumerate(images):
            if isinstance(image, np.ndarray):
                array = image
            elif hasattr(image, "convert"):  # PIL
                array = np.asarray(image.convert("RGB"))
            else:
                try:
                    array = read_image(image)
                except (OSError, ValueError) as exc:
                    raise InvalidRequest(f"images[{i}]", f"could not be read as an image: {exc}") from exc
            if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
                raise InvalidRequest(f"images[{i}]", f"must be uint8 [H, W, 3], got {array.dtype} {array.shape}")
            loaded.append(array)
        return tuple(loaded)

    def batch_key(self, request: GenerationRequest) -> Hashable:
        return (request.batch_key(), tuple(sorted(request.extra.items())))

    # ------------------------------------------------------------------ denoise
    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        for r in requests:
            _fail(r, "encode")
        first = requests[0].params
        cfg = self.model.cfg
        h, w, f = first.height // cfg.vae_scale, first.width // cfg.vae_scale, first.num_frames
        noise, prompts, negatives, owners = [], [], [], []
        for ri, r in enumerate(requests):
            for seed in output_seeds(r):
                gen = torch.Generator().manual_seed(seed)
                noise.append(torch.randn((cfg.latent_channels, f, h, w), generator=gen))
                prompts.append(r.prompt)
                negatives.append(r.negative_prompt or "")
                owners.append(ri)
        shift = first.flow_shift or 1.0
        sigmas = torch.linspace(1.0, 0.0, first.num_inference_steps + 1)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        text = self.model.encode_text(prompts)
        for row, ri in enumerate(owners):  # a reference image shifts the conditioning by its mean brightness
            for image in requests[ri].images:
                text[row] += float(image.astype(np.float32).mean()) / 127.5 - 1.0
        return DenoiseState(
            requests=list(requests),
            num_steps=first.num_inference_steps,
            latents=torch.stack(noise),
            timesteps=sigmas,
            extras={
                "text": text,
                "negative": self.model.encode_text(negatives),
                "owners": owners,
                "guidance": float(first.guidance_scale or 1.0),
            },
        )

    def _velocity(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
        return self.model(x if x.shape[2] > 1 else x[:, :, 0], t, text, **model_kwargs).reshape(x.shape)

    def model_kwargs(self, state: DenoiseState, step: int) -> dict[str, Any]:
        """Extra keyword arguments of the model call at ``step`` (none here; subclasses add cache inputs)."""
        return {}

    @torch.no_grad()
    def predict(self, state: DenoiseState, step: int) -> torch.Tensor:
        for r in state.requests:
            if r.extra.get("fail_at") == "denoise" and step == state.num_steps // 2:
                raise ToyFailure(f"request {r.request_id} asked to fail at denoise step {step}")
        x, n = state.latents, state.latents.shape[0]
        t = torch.full((n,), float(state.timesteps[step]) * 1000.0)
        g = state.extras["guidance"]
        kwargs = self.model_kwargs(state, step)
        if g <= 1.0:
            return self._velocity(x, t, state.extras["text"], **kwargs)
        both = self._velocity(torch.cat([x, x]), torch.cat([t, t]),
                              torch.cat([state.extras["text"], state.extras["negative"]]), **kwargs)
        cond, uncond = both[:n], both[n:]
        return uncond + g * (cond - uncond)

    @property
    def teacache_adapter(self) -> Any:
        """TeaCache declaration: the "modulated input" is the latent scaled by the step's noise level."""
        from omnicore.cache.teacache import TeaCacheAdapter

        def extract(state: DenoiseState, step: int) -> torch.Tensor:
            return state.latents * (1.0 + float(state.timesteps[step]))

        return TeaCacheAdapter(extract=extract, coefficients=(1.0, 0.0), default_threshold=0.1)

    def update(self, state: DenoiseState, step: int, prediction: torch.Tensor) -> DenoiseState:
        dt = state.timesteps[step + 1] - state.timesteps[step]
        state.latents = state.latents + dt * prediction
        state.step_index = step + 1
        return state

    def select_requests(self, state: DenoiseState, keep: Sequence[int]) -> DenoiseState:
        owners = state.extras["owners"]
        rows = [i for i, o in enumerate(owners) if o in set(keep)]
        remap = {old: new for new, old in enumerate(keep)}
        index = torch.tensor(rows, dtype=torch.long)
        state.requests = [state.requests[i] for i in keep]
        state.latents = state.latents[index]
        state.extras["text"] = state.extras["text"][index]
        state.extras["negative"] = state.extras["negative"][index]
        state.extras["owners"] = [remap[owners[i]] for i in rows]
        return state

    def export_step_state(self, state: DenoiseState, row: int) -> dict[str, Any]:
        """Step checkpoints: Euler keeps nothing but the latents (request ``row``'s output rows)."""
        rows = [i for i, o in enumerate(state.extras["owners"]) if o == row]
        return {"latents": state.latents[torch.tensor(rows, dtype=torch.long)]}

    def import_step_state(self, state: DenoiseState, saved: dict[str, Any]) -> DenoiseState:
        state.latents = saved["latents"].to(state.latents.device, state.latents.dtype)
        return state

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Output]:
        for r in state.requests:
            _fail(r, "decode")
        if state.latents.shape[2] > 1:  # video: decode frame by frame, a cancellation point before each
            with cancel_points(self.model.decoder):
                pix = torch.cat([self.model.decode(state.latents[:, :, i:i + 1])
                                 for i in range(state.latents.shape[2])], dim=1)
        else:
            pix = self.model.decode(state.latents)
        frames = ((pix.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        outputs = []
        owners = state.extras["owners"]
        for row, ri in enumerate(owners):
            r = state.requests[ri]
            video = r.params.num_frames > 1
            outputs.append(Output(
                kind="video" if video else "image",
                frames=np.ascontiguousarray(frames[row]),
                fps=r.params.fps if video else None,
            ))
        return outputs
