"""Qwen3-VL as a text encoder: loading it from a checkpoint folder, and the tiny random-weight one presets write.

LingBot and MiniMax-H3 both condition on transformers' ``Qwen3VLForConditionalGeneration`` (its inner
``Qwen3VLModel``; the LM head is never used) and both build the same tiny stand-in for their ``tiny:`` presets. The
two copies lived in the plugins; this module is the one both call (through ``omnicore.plugin``).

Under ``--parallel tp=N`` the language model's decoder is sharded over the TP ranks with the core's plan machinery
(:func:`qwen3_vl_tp_plan`; ``load_qwen3_vl(..., tp=(rank, N))`` reads only this rank's rows). The vision
tower, the embeddings and the norms stay whole on every rank.

We read the tokenizer and the Qwen2-VL image processor on their own, never ``Qwen3VLProcessor``: that class insists
on a video processor, which needs torchvision. Needs ``transformers`` (and ``tokenizers`` for the tiny tokenizer),
imported inside the functions: the core never imports them on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tiny_checkpoints import byte_level_tokenizer

if TYPE_CHECKING:
    import torch

    from ..parallel.tensor_parallel import TensorParallelPlan

#: the Qwen chat and vision special tokens the tiny tokenizer carries, in id order after the 256 byte symbols
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)


def load_qwen3_vl(text_encoder_dir: Path, tokenizer_dir: Path, processor_dir: Path | None = None, *,
                  device: torch.device | str, dtype: torch.dtype, layers: int | None = None,
                  tp: tuple[int, int] | None = None, plugin: str = "omnicore") -> tuple[Any, Any, Any]:
    """``(model, tokenizer, image_processor)``: the checkpoint's ``Qwen3VLModel`` on ``device`` in eval mode
    without gradients, the tokenizer of ``tokenizer_dir`` and the image processor of ``processor_dir`` (default:
    ``tokenizer_dir``).

    ``layers``: build and load only the first ``layers`` decoder layers (a model that reads an inner layer's
    output never needs the later ones; their weights are skipped, not read). More than the checkpoint has is a
    ``ValueError`` naming both numbers.

    ``tp = (rank, degree)``: only that tensor-parallel rank's shard of the decoder's attention and MLP linears is
    read (:func:`load_sharded_qwen3_vl`; ``model.tp_bytes_read`` records the bytes read); the model then joins its
    shards with :func:`omnicore.plugin.parallelize` and :func:`qwen3_vl_tp_plan`. A head or FFN count the
    degree does not divide is a ``ConfigError`` naming the numbers, before anything is read. ``plugin`` names the
    caller in checkpoint errors.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    if tp is not None:
        model = load_sharded_qwen3_vl(text_encoder_dir, dtype=dtype, layers=layers, rank=tp[0], degree=tp[1],
                                      plugin=plugin)
    else:
        model = _load_whole(text_encoder_dir, dtype, layers)
    model = model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    image_processor = AutoImageProcessor.from_pretrained(str(processor_dir if processor_dir is not None
                                                             else tokenizer_dir))
    return model, tokenizer, image_processor


def _load_whole(text_encoder_dir: Path, dtype: torch.dtype, layers: int | None) -> Any:
    """The ``Qwen3VLModel`` through transformers' own ``from_pretrained`` (only ``layers`` decoder layers)."""
    from transformers import Qwen3VLForConditionalGeneration

    if layers is None:
        return Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), dtype=dtype).model
    config = truncated_config(text_encoder_dir, layers)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped layers are reported as unused weights
    try:
        full = Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    return full.model


def truncated_config(text_encoder_dir: Path, layers: int | None) -> Any:
    """The checkpoint's ``Qwen3VLConfig`` with only its first ``layers`` decoder layers (all when None); more
    than it has is a ``ValueError`` naming both numbers."""
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig.from_pretrained(str(text_encoder_dir))
    if layers is None:
        return config
    text: Any = config.text_config
    if text.num_hidden_layers < layers:
        raise ValueError(f"{text_encoder_dir}: {text.num_hidden_layers} decoder layers, {layers} asked for")
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    return config


def qwen3_vl_tp_plan(text_config: Any) -> TensorParallelPlan:
    """The tensor-parallel plan of a Qwen3-VL language model (``Qwen3VLTextConfig``), over the module names of
    ``Qwen3VLModel`` (``language_model.layers.N...``) and the stored names (``model.language_model...``) alike.

    Megatron's placement, one all-reduce per attention and one per MLP: ``q_proj``, ``k_proj`` and ``v_proj``
    column-parallel (their rows are head-major, so rank ``r`` holds query heads ``r·H/N ...`` and key/value heads
    ``r·K/N ...``: under grouped-query attention each rank keeps whole K/V heads and the query heads that share
    them), ``o_proj`` row-parallel; the SwiGLU's ``gate_proj`` and ``up_proj`` column, ``down_proj`` row. The
    per-head q/k norms, the embeddings, the layer norms and the vision tower stay replicated. The degree must
    divide the query heads, the key/value heads and the FFN width."""
    from ..parallel.tensor_parallel import ShardRule, TensorParallelPlan

    layer = "*language_model.layers.*."
    rules = [ShardRule(f"{layer}self_attn.{name}_proj", "column") for name in ("q", "k", "v")]
    rules += [ShardRule(f"{layer}self_attn.o_proj", "row"), ShardRule(f"{layer}mlp.gate_proj", "column"),
              ShardRule(f"{layer}mlp.up_proj", "column"), ShardRule(f"{layer}mlp.down_proj", "row")]
    divisors = (("text-encoder attention heads", int(text_config.num_attention_heads)),
                ("text-encoder key/value heads", int(text_config.num_key_value_heads)),
                ("text-encoder FFN width", int(text_config.intermediate_size)))
    return TensorParallelPlan(rules, divisors)


#: stored tensor name -> (Qwen3VLModel's name, decoder layer index or None); lm_head and other heads are dropped
_STORED_PREFIX = "model."
_LAYER_PREFIX = "language_model.layers."


def _decoder_layer(name: str) -> int | None:
    if not name.startswith(_LAYER_PREFIX):
        return None
    return int(name[len(_LAYER_PREFIX):].split(".", 1)[0])


def load_sharded_qwen3_vl(text_encoder_dir: Path, *, dtype: torch.dtype, layers: int | None, rank: int, degree: int,
                          plugin: str = "omnicore") -> Any:
    """This TP rank's ``Qwen3VLModel`` (on the CPU), read shard-only: built on the meta device, its planned linears
    narrowed to ``rank``'s share (:func:`omnicore.plugin.shard_module`), then the stored tensors it needs are read
    (``read_sharded_state_dict``: the other ranks' rows, the LM head and the decoder layers past ``layers`` never
    leave the files) and taken over without a second copy. The rotary tables (buffers no checkpoint stores) are
    computed again on the CPU. ``model.tp_bytes_read`` holds the bytes read."""
    import torch
    from transformers import Qwen3VLModel

    from ..checkpoint import aligned, load_strict
    from ..parallel.tensor_parallel import read_sharded_state_dict, shard_module

    config = truncated_config(text_encoder_dir, layers)
    plan = qwen3_vl_tp_plan(config.text_config)
    plan.check(degree)
    depth = int(config.text_config.num_hidden_layers)

    def keep(stored: str) -> bool:
        if not stored.startswith(_STORED_PREFIX):
            return False  # lm_head: the encoder never predicts tokens
        index = _decoder_layer(stored[len(_STORED_PREFIX):])
        return index is None or index < depth

    stored, nbytes = read_sharded_state_dict(text_encoder_dir, plan, rank=rank, degree=degree, plugin=plugin,
                                             component="text_encoder", keep=keep)
    state = {name[len(_STORED_PREFIX):]: aligned(t.to(dtype)) for name, t in stored.items()}
    del stored
    with torch.device("meta"):
        model: Any = Qwen3VLModel(config)
    shard_module(model, plan, rank=rank, degree=degree)
    load_strict(model, state, plugin=plugin, path=text_encoder_dir, component="text_encoder", assign=True)
    del state
    _rebuild_rotary_tables(model)
    object.__setattr__(model, "tp_bytes_read", nbytes)
    return model


def _rebuild_rotary_tables(model: Any) -> None:
    """Replace every module still holding meta buffers (transformers' rotary embeddings: their ``inv_freq`` is a
    non-persistent buffer computed from the config in ``__init__``) with one built on the CPU from its config."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        config = getattr(module, "config", None)
        if config is None or any(p.is_meta for p in module.parameters()):
            raise RuntimeError(f"{type(model).__name__}.{name}: a buffer has no value after the load")
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, type(module)(config))


def build_tiny_qwen3_vl(text_encoder_dir: Path, processor_dir: Path, seed: int, *, tokenizer_dir: Path | None = None,
                        hidden_size: int = 32, layers: int = 2, heads: int = 2,
                        kv_heads: int = 1) -> dict[str, int]:
    """Write a random-weight Qwen3-VL in the release layout and return the special tokens' ids (and
    ``"__vocab_size__"``).

    The tokenizer is a merge-free byte-level BPE (any text encodes) with :data:`QWEN_SPECIAL_TOKENS`, written to
    ``tokenizer_dir`` and copied into ``processor_dir`` when given, else written to ``processor_dir``; the image
    processor is Qwen2-VL's (patch 16, merge 2, temporal patch 2). The model: ``layers`` decoder layers of width
    ``hidden_size`` (``heads`` heads of 16 sharing ``kv_heads`` K/V heads, interleaved M-RoPE) and a 1-layer vision
    tower whose merged output is ``hidden_size`` wide, initialised under ``torch.manual_seed(seed)``. Tiny weights
    give noise.
    """
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = byte_level_tokenizer(tokenizer_dir if tokenizer_dir is not None else processor_dir, QWEN_SPECIAL_TOKENS,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {**tok.special_ids, "__vocab_size__": tok.vocab_size}
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(processor_dir))
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(str(processor_dir))
    config = Qwen3VLConfig(
        text_config={
            "hidden_size": hidden_size, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 16,
            "vocab_size": tok.vocab_size,
            "max_position_embeddings": 65536,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden_size,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    import torch

    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).save_pretrained(str(text_encoder_dir))
    return ids
