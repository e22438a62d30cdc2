"""Entry-point module (``[project.entry-points.omnicore] minimax_h3``): registers the ``minimax-h3`` model spec.

Imported by every omnicore process that lists plugins, so it must stay cheap: no torch, diffusers or transformers
here — the pipeline and the preset builders are named by lazy ``"module:attr"`` paths.
"""

from __future__ import annotations

from omnicore.plugin import (
    PARALLEL_VAE_DECODE_OPTION,
    TEXT_ENCODER_OFFLOAD_OPTION,
    InputRole,
    LoRATargets,
    ModelCapabilities,
    ModelOption,
    ModelSpec,
    PresetSpec,
    RequestDefaults,
    model_plugin,
)

from .request_rules import ASPECT_RATIOS, EXTRA_FIELDS, frame_limits  # torch-free, like this module

__version__ = "0.1.0"

PIPELINE_CLASS = "MiniMaxH3ModularPipeline"
TRANSFORMER_CLASS = "MiniMaxH3Transformer3DModel"

#: TeaCache polynomial for the FL2VA DiT, highest power first.
TEACACHE_COEFFICIENTS = (2.283704065852778e3, -7.775977277886368e2, 9.408414741359490e1, -4.232669906169421,
                         2.173782527946167e-1)
#: The model's calibrated TeaCache threshold (the global default is 0.2).
TEACACHE_THRESHOLD = 0.17

MODES = ("t2va", "fl2va", "ref2va")

#: Conditioning roles (COORD interface A). The first role taking a kind is that kind's default role, so a bare
#: ``images=[...]`` is a first keyframe (fl2va) and bare videos/audios are references (ref2va).
INPUT_ROLES = (
    InputRole("first_frame", ("image",), 1, "fl2va: the keyframe the video starts from", modes=("fl2va",)),
    InputRole("last_frame", ("image",), 1, "fl2va: the keyframe the video ends on", modes=("fl2va",)),
    InputRole("reference", ("image", "video", "audio"), 12,
              "ref2va: up to 9 images, 3 videos (with their soundtracks) and 3 audio clips, in the order the model "
              "reads them", modes=("ref2va",)),
)

CAPABILITIES = ModelCapabilities(
    modes=MODES,
    outputs=("video", "audio"),
    supports_batching=True,  # requests of any size pack into one DiT forward per step
    max_outputs_per_request=10,
    cache_methods=("teacache", "adaln_schedule"),
    # step checkpoints: the request's packed video/audio rows (Euler, eta 0: no history, no noise after encode)
    checkpointable=True,
    needs_packed_varlen=True,
    inputs=INPUT_ROLES,
    max_inputs=12,
    size_multiple_of=32,
    fps_range=(24.0, 24.0),
    frame_rule="17n+5",
    max_frames=frame_limits()[1],  # what the 15 s cap generates on the 17n+5 grid: 362
    # --parallel: the packed batch's rows sharded over Ulysses ranks, the DiT's linears split over TP ranks;
    # no cfg (guidance-distilled: one branch)
    parallel=("ulysses", "tp"),
)

DEFAULTS = RequestDefaults(
    height=768, width=1344, num_frames=209, fps=24.0, num_inference_steps=49, guidance_scale=1.0, flow_shift=12.0,
    negative_prompt=None, seed=42,
)

#: Tiny presets answer in about a second: 3 denoise steps unless a request asks for more.
TINY_DEFAULTS = RequestDefaults(
    height=64, width=128, num_frames=107, fps=24.0, num_inference_steps=3, guidance_scale=1.0, flow_shift=12.0,
    negative_prompt=None, seed=42,
)

PRESETS = (
    PresetSpec(name="tiny:minimax-h3", builder="omni_minimax_h3.presets:build_tiny_fl2va",
               description="random-weight FL2VA partition (t2va, fl2va): DiT hidden 64 x 2 blocks, 51-layer "
                           "hidden-32 Qwen3-VL, tiny video and audio VAEs, 64-pixel canvas",
               defaults=TINY_DEFAULTS, modes=("t2va", "fl2va")),
    PresetSpec(name="tiny:minimax-h3-ref2va", builder="omni_minimax_h3.presets:build_tiny_ref2va",
               description="random-weight Ref2VA partition (ref2va only), same components as tiny:minimax-h3",
               defaults=TINY_DEFAULTS, modes=("ref2va",)),
)

OPTIONS = (
    ModelOption("partition", "str", default=None, choices=("fl2va", "ref2va", "combined"),
                help="which DiT partitions of the repository to load (default: every one present); fl2va serves "
                     "t2va and fl2va, ref2va serves ref2va, combined both"),
    ModelOption("rainfusion_sparsity", "float", default=None,
                help="share of video key blocks each query block drops under a block-sparse attention backend "
                     "(npu_rainfusion; default 0.8; other backends ignore it)"),
    ModelOption("rainfusion_skip_layers", "str", default=None,
                help="DiT layers that stay dense under a block-sparse attention backend, e.g. '0-3,38'"),
    PARALLEL_VAE_DECODE_OPTION,  # --parallel: each clip's VAE tiles (the native tile mode) decoded across the ranks
    TEXT_ENCODER_OFFLOAD_OPTION,  # cpu: the 51.5 GB Qwen3-VL conditioner in rank 0's host memory, encoding there
)

#: Per-request fields (``model_params``) declared for clients such as the playground; request_rules checks them.
REQUEST_FIELDS = (
    ModelOption("aspect_ratio", "str", default=None, choices=tuple(ASPECT_RATIOS),
                help="canvas aspect ratio: required for t2va unless height and width match one (it is then "
                     "derived); with an explicit size it must agree with it; fl2va defaults to the first "
                     "keyframe's ratio, ref2va to 16:9",
                required_for=("t2va",), unless=("height", "width"), example="16:9"),
    ModelOption("task", "str", default=None, choices=MODES,
                help="t2va, fl2va or ref2va; default: inferred from the conditioning inputs"),
)

#: Per-request LoRA (``loras=[LoRA(...)]``, ``--lora``, HTTP ``lora``) on the DiT of every task partition
#: (``transformers``: one adapter fits FL2VA and Ref2VA alike): the attention and MLP linears of the blocks and of the
#: token refiner (which refines each request's own text rows). The AdaLN projections are not adaptable: they run on
#: a batch's distinct timesteps, one row shared by every request at that timestep, and the adaln_schedule cache
#: precomputes them; nor are the patch embedders, the text projection or the output heads. Adapters in diffusers'
#: names (``transformer_blocks.N.attn.to_q``, ``ff.net.0.proj``, ...) or the release's head-grouped fused qkv are
#: converted by omni_minimax_h3.lora.
LORA_TARGETS = LoRATargets(
    root="transformers",
    modules=("blocks.*.attn.qkv_proj", "blocks.*.attn.out_proj", "blocks.*.mlp.fc1", "blocks.*.mlp.fc2",
             "token_refiner.blocks.*.attn.qkv_proj", "token_refiner.blocks.*.attn.out_proj",
             "token_refiner.blocks.*.mlp.fc1", "token_refiner.blocks.*.mlp.fc2"),
    converter="omni_minimax_h3.lora:checkpoint_to_ours",
    kohya_names="omni_minimax_h3.lora:kohya_names",
)

MODEL_SPEC = ModelSpec(
    name="minimax-h3",
    impl="omni_minimax_h3.pipeline:MiniMaxH3Pipeline",
    description="MiniMax-H3 joint video + audio: text (t2va), first/last keyframes (fl2va), references (ref2va)",
    aliases=(PIPELINE_CLASS.lower(), TRANSFORMER_CLASS.lower(), "minimaxh3pipeline"),
    detect="omni_minimax_h3.detect:detect",
    capabilities=CAPABILITIES,
    defaults=DEFAULTS,
    presets=PRESETS,
    options=OPTIONS,
    request_fields=REQUEST_FIELDS,
    extra_fields=EXTRA_FIELDS,
    lora=LORA_TARGETS,
)


#: plugin_info() (kind, version, the spec's name and presets) and the registration hook, derived from MODEL_SPEC
plugin_info, omnicore_register_models = model_plugin(MODEL_SPEC, api=">=1.7,<2", version=__version__)
