"""Entry-point module (``[project.entry-points.omnicore] hunyuan``): registers the ``hunyuan-image3`` model.

Must import quickly and never import torch: everything heavy is named by a lazy ``"module:attr"`` path.
"""

from __future__ import annotations

import attrs
from omnicore.plugin import (
    PARALLEL_VAE_DECODE_OPTION,
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
from .detect import ARCHITECTURE
from .request_rules import EXTRA_FIELDS  # torch-free, like this module

KV_MODES = ("dense_legacy", "paged_scheduler", "paged_worker_local")

CAPABILITIES = ModelCapabilities(
    modes=("t2i", "edit"),
    outputs=("image",),
    max_reference_images=2,
    supports_batching=True,
    max_outputs_per_request=1,
    cache_methods=(),
    inputs=(InputRole("edit_source", ("image",), 2, "condition image(s) of an edit (VAE + SigLIP2 tokens)"),),
    size_multiple_of=16,
    # --parallel: tp=N splits attention heads, MLPs and experts' widths over the ranks; cfg=2 puts the guided
    # rows (conditional, unconditional) on two ranks, each keeping the prompt K/V of its row; ep=N partitions the
    # routed experts
    parallel=("tp", "cfg", "ep"),
    # step checkpoints: the request's latents (Euler); the prompt K/V kept between steps is recomputed on resume
    checkpointable=True,
)

DEFAULTS = RequestDefaults(
    height=1024,
    width=1024,
    num_frames=1,
    num_inference_steps=50,
    guidance_scale=5.0,
    flow_shift=3.0,
    negative_prompt=None,
)

OPTIONS = (
    ModelOption("kv_mode", "str", "dense_legacy", KV_MODES,
                "diffusion KV: dense_legacy (per-request prefix K/V) or paged_scheduler (prepared layout at "
                "admission and a shared, content-hashed prefix block pool); paged_worker_local is reserved"),
    ModelOption("kv_block_size", "int", 16, None, "tokens per prefix-KV block (paged_scheduler)"),
    ModelOption("kv_pool_blocks", "int", 512, None, "prefix-KV pool budget in blocks, LRU-evicted (paged_scheduler)"),
    ModelOption("kv_reuse", "bool", True, None,
                "reuse the prompt K/V across denoise steps (off: recompute the full sequence every step)"),
    ModelOption("sampler_grid", "str", "release", ("release", "diffusers"),
                "timestep grid: release (the original release's, shift applied once) or diffusers "
                "(FlowMatchEulerDiscreteScheduler's, as the reference serving system uses; low end shifted twice)"),
    ModelOption("ep_dispatch", "str", "all_to_all", ("all_to_all", "all_reduce"),
                "--parallel ep=N: send token copies to their experts' ranks and back (all_to_all), or run each "
                "rank's experts on the replicated tokens and all-reduce the shares (all_reduce: fewer bytes when "
                "k > 1, see benchmarks/parallel.py)"),
    ModelOption("vae_tile_size", "int", None, None,
                "decode the image in overlapping square VAE tiles of this many pixels (a multiple of 16; default: "
                "untiled, as released). Bounds the decoder's memory; a tiled image is close to, not equal to, the "
                "untiled one; under --parallel the tiles are decoded across the ranks"),
    ModelOption("vae_tile_overlap", "int", None, None,
                "pixels two neighbouring VAE tiles share and blend over (a multiple of 16, below vae_tile_size; "
                "default: a quarter of the tile)"),
    ModelOption("text_max_new_tokens", "int", 2048, None,
                "the text stage's token budget cap (think / recaption): a request's extra.max_new_tokens above it "
                "is refused; without one the budget is the checkpoint's generation config, else this cap"),
    PARALLEL_VAE_DECODE_OPTION,
)

PRESETS = (
    PresetSpec(name="tiny:hunyuan-image3", builder="omni_hunyuan.presets:build_tiny_hunyuan_image3",
               description="random-weight HunyuanImage-3 (hidden 64, 2 MoE layers, 32-channel 3-D VAE, tiny SigLIP2)",
               defaults=attrs.evolve(DEFAULTS, height=256, width=256, num_inference_steps=4)),
)

#: Per-request LoRA (``loras=[LoRA(...)]``, ``--lora``, HTTP ``lora``) on the language model's image stage: the
#: attention (fused ``qkv_proj``, ``o_proj``) and the shared / dense MLP linears of every layer. Routed experts and
#: the router are not adaptable (stacked weights, chosen per token); nor are the timestep and patch embedders, the
#: image head, the ViT or the LM head. Adapters are read in the released checkpoint's names and layouts (grouped
#: qkv rows, fused ``gate_and_up_proj``; see omni_hunyuan.lora). The text stage (think / recaption) writes its text
#: on the base weights; the image stage then recomputes the prompt's K/V with the request's adapters.
LORA_TARGETS = LoRATargets(
    root="model",
    modules=("model.layers.*.self_attn.qkv_proj", "model.layers.*.self_attn.o_proj",
             "model.layers.*.mlp.shared_mlp.gate_proj", "model.layers.*.mlp.shared_mlp.up_proj",
             "model.layers.*.mlp.shared_mlp.down_proj",
             "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj"),
    converter="omni_hunyuan.lora:checkpoint_to_ours",
    kohya_names="omni_hunyuan.lora:kohya_names",
)

MODEL_SPEC = ModelSpec(
    name="hunyuan-image3",
    impl="omni_hunyuan.pipeline:HunyuanImage3Pipeline",
    description="HunyuanImage-3.0: text-to-image and image edit in a unified MoE language model",
    aliases=(ARCHITECTURE.lower(), "hunyuanimage3", "hunyuan"),
    detect="omni_hunyuan.detect:detect",
    capabilities=CAPABILITIES,
    defaults=DEFAULTS,
    presets=PRESETS,
    options=OPTIONS,
    extra_fields=EXTRA_FIELDS,
    lora=LORA_TARGETS,
)


#: plugin_info() (kind, version, the spec's name and presets) and the registration hook, derived from MODEL_SPEC
plugin_info, omnicore_register_models = model_plugin(MODEL_SPEC, api=">=1.7,<2", version=__version__)
