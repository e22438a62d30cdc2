"""Entry-point module (``[project.entry-points.omnicore] lingbot``): registers the ``lingbot`` model spec.

Must import quickly and never import torch: everything heavy is named by a lazy ``"module:attr"`` path.
"""

from __future__ import annotations

import attrs
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

from . import __version__
from .detect import PIPELINE_CLASS, TRANSFORMER_CLASS
from .request_rules import EXTRA_FIELDS  # torch-free, like this module

CAPABILITIES = ModelCapabilities(
    modes=("t2i", "t2v", "ti2v"),
    outputs=("image", "video"),
    max_reference_images=1,
    # TI2V: one image whose latent is the clip's clean first frame (and which the text encoder
    # also sees); with no role given (``images=[...]``) an image takes this role.
    inputs=(InputRole("first_frame", ("image",), 1, "image-to-video: the clip's first frame"),),
    max_inputs=1,
    size_multiple_of=16,
    frame_rule="4n+1",
    # Work limits checked on the resolved request (engine/limits.py): beyond the largest trained buckets
    # (720p, a few seconds) by a wide margin, but they stop absurd requests (seconds=3600) at submission.
    max_pixels=1920 * 1088,
    max_frames=481,
    supports_batching=True,
    max_outputs_per_request=1,
    cache_methods=("first_block_cache",),  # teacache needs per-model coefficients LingBot does not publish
    needs_packed_varlen=True,  # the DiT's attention takes cu_seqlens documents (batch CFG, batched requests)
    # --parallel: branches on CFG ranks; packed rows sharded over Ulysses ranks; MoE experts over EP ranks
    parallel=("cfg", "ulysses", "ep"),
    # step checkpoints: latents, clean prefix, stage and the UniPC history per request (pipeline.export_step_state)
    checkpointable=True,
)

DEFAULTS = RequestDefaults(
    height=480,
    width=480,
    num_frames=81,
    fps=24.0,
    num_inference_steps=40,
    guidance_scale=6.0,
    flow_shift=3.0,
    negative_prompt=None,  # the default depends on the mode (video vs image); see omni_lingbot.prompts
)

#: Tiny presets output noise, so they default to what answers in seconds on a CPU (a request still may ask for
#: any size): 48x48, 5 frames, 4 steps.
TINY_DEFAULTS = attrs.evolve(DEFAULTS, height=48, width=48, num_frames=5, num_inference_steps=4)

PRESETS = (
    PresetSpec(name="tiny:lingbot", builder="omni_lingbot.presets:build_tiny_lingbot",
               description="random-weight dense LingBot (hidden 64, 2 blocks, tiny Qwen3-VL and Wan VAE)",
               defaults=TINY_DEFAULTS),
    PresetSpec(name="tiny:lingbot-moe", builder="omni_lingbot.presets:build_tiny_lingbot_moe",
               description="random-weight LingBot with block 1 a grouped top-2 MoE", defaults=TINY_DEFAULTS),
)

#: Deployment options (``--model-option KEY=VALUE``; ``@PATH`` reads the value from a file). Unset, each comes from
#: the checkpoint's file (prompt_template.txt, default_negative_prompt[_image].json/.txt), else our built-in text;
#: see omni_lingbot.prompts and the README.
OPTIONS = (
    ModelOption("prompt_template", "str", None, help="chat template around the caption, exactly one '{}' slot "
                                                    "(default: the checkpoint's prompt_template.txt, else built-in)"),
    ModelOption("negative_prompt", "str", None, help="default negative prompt of the video modes (default: the "
                                                    "checkpoint's default_negative_prompt.json, else built-in)"),
    ModelOption("negative_prompt_image", "str", None, help="default negative prompt of text-to-image (default: the "
                                                          "checkpoint's default_negative_prompt_image.json, else "
                                                          "built-in)"),
    ModelOption("rainfusion_sparsity", "float", None, help="share of video key blocks each query block drops under a "
                                                          "block-sparse attention backend (npu_rainfusion; default "
                                                          "0.8; other backends ignore it)"),
    ModelOption("rainfusion_skip_layers", "str", None, help="DiT layers that stay dense under a block-sparse "
                                                           "attention backend, e.g. '0-3,38'"),
    ModelOption("ep_dispatch", "str", "all_to_all", choices=("all_to_all", "all_reduce"),
                help="--parallel ep=N: send token copies to their experts' ranks and back (all_to_all), or run "
                     "each rank's experts on the replicated tokens and all-reduce the shares (all_reduce: fewer "
                     "bytes when k > 1, see benchmarks/parallel.py)"),
    PARALLEL_VAE_DECODE_OPTION,  # --parallel: a tiled request's VAE tiles (extra.vae_tiling) decoded across ranks
    TEXT_ENCODER_OFFLOAD_OPTION,  # cpu: the Qwen3-VL encoder in rank 0's host memory, encoding there
)

#: Per-request LoRA (``loras=[LoRA(...)]``, ``--lora``, HTTP ``lora``): the attention and FFN linears of every block
#: (the dense FFN, or an MoE block's shared experts; routed experts are stacked weights and the router decides the
#: routing, neither is adaptable), the patch embedder, the output head and the two timestep modulations (LingBot has
#: no AdaLN schedule cache, so nothing precomputes them). The text embedder runs on the real text tokens of every
#: sample packed together, rows an adapter could not tell apart: not adaptable. Module names are the diffusers
#: checkpoint's (``transformer.blocks.0.attn.to_q``), so PEFT, diffusers and kohya files need no renaming. The MoE
#: package's refiner DiT (``extra.run_refiner``) is a second network: its steps run on its own weights.
LORA_TARGETS = LoRATargets(
    modules=("blocks.*.attn.to_q", "blocks.*.attn.to_k", "blocks.*.attn.to_v", "blocks.*.attn.to_out",
             "blocks.*.ffn.gate_proj", "blocks.*.ffn.up_proj", "blocks.*.ffn.down_proj",
             "blocks.*.ffn.shared_experts.gate_proj", "blocks.*.ffn.shared_experts.up_proj",
             "blocks.*.ffn.shared_experts.down_proj",
             "patch_embedder", "proj_out", "time_modulation.1", "norm_out_modulation.1"),
)

MODEL_SPEC = ModelSpec(
    name="lingbot",
    impl="omni_lingbot.pipeline:LingBotPipeline",
    description="LingBot-Video dense and MoE: text-to-image, text-to-video, image-to-video",
    aliases=(PIPELINE_CLASS.lower(), TRANSFORMER_CLASS.lower()),
    detect="omni_lingbot.detect:detect",
    capabilities=CAPABILITIES,
    defaults=DEFAULTS,
    presets=PRESETS,
    options=OPTIONS,
    extra_fields=EXTRA_FIELDS,
    lora=LORA_TARGETS,
)


#: plugin_info() (kind, version, the spec's name and presets) and the registration hook, derived from MODEL_SPEC
plugin_info, omnicore_register_models = model_plugin(MODEL_SPEC, api=">=1.7,<2", version=__version__)
