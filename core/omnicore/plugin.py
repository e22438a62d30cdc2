"""The public API for plugin authors: everything a model, backend or cache plugin imports from omnicore.

Import from here (``from omnicore.plugin import BasePipeline, ModelSpec, hookimpl``); every other module of
``omnicore`` is internal and may change in any release.

Stability promise, tied to :data:`PLUGIN_API_VERSION` (``MAJOR.MINOR``, semver):

- a name listed here keeps its meaning within a major version; a minor version only adds names, or adds
  optional fields (with defaults) to the records listed here;
- removing or renaming a name, or changing what one means, bumps the major version, and plugins declare the
  range they work with (``plugin_info()["api"] = ">=1.0,<2"``), checked before they are imported.

``tests/core/test_plugin_api.py`` holds the checked-in list of these names and fails when one disappears.

Importing this module is cheap and never imports torch: names load on first use, so a plugin's entry module
may import its spec records from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._lazy import lazy_getattr
from ._version import PLUGIN_API_VERSION
from .hookspecs import hookimpl

_LAZY: dict[str, str] = {
    # -- registration: spec records a plugin passes to ``register`` (cheap, no torch) ----------------------
    "ModelSpec": "omnicore.specs:ModelSpec",
    "ModelCapabilities": "omnicore.specs:ModelCapabilities",
    "RequestDefaults": "omnicore.specs:RequestDefaults",
    "PresetSpec": "omnicore.specs:PresetSpec",
    "PlatformSpec": "omnicore.specs:PlatformSpec",
    "AttentionBackendSpec": "omnicore.specs:AttentionBackendSpec",
    "AttentionCapabilities": "omnicore.specs:AttentionCapabilities",
    "AttentionRequirement": "omnicore.specs:AttentionRequirement",
    "CacheMethodSpec": "omnicore.specs:CacheMethodSpec",
    # an entry module's plugin_info and omnicore_register_models, derived from its model specs (1.7)
    "model_plugin": "omnicore.registration:model_plugin",
    # -- the pipeline protocol and the records it threads ---------------------------------------------------
    "Pipeline": "omnicore.engine.protocol:Pipeline",
    "BasePipeline": "omnicore.engine.protocol:BasePipeline",
    "DenoiseState": "omnicore.engine.protocol:DenoiseState",
    "LoadOptions": "omnicore.engine.protocol:LoadOptions",
    "output_seeds": "omnicore.engine.protocol:output_seeds",
    "GenerationRequest": "omnicore.engine.request:GenerationRequest",
    "SamplingParams": "omnicore.engine.request:SamplingParams",
    "MAX_SEED": "omnicore.engine.request:MAX_SEED",  # seeds are ints in [0, MAX_SEED]; output i uses seed + i
    "random_seed": "omnicore.engine.request:random_seed",
    "Output": "omnicore.outputs.output:Output",
    "read_image": "omnicore.outputs.readers:read_image",
    # -- media inputs with roles and deployment options -------------------------------------------------------
    "MediaInput": "omnicore.engine.request:MediaInput",
    "InputRole": "omnicore.specs:InputRole",
    "ModelOption": "omnicore.specs:ModelOption",
    "VideoClip": "omnicore.media:VideoClip",
    "AudioClip": "omnicore.media:AudioClip",
    "load_media": "omnicore.media:load_media",
    # the engine's capability check, for a preprocess that callers may reach without the engine (pure, idempotent)
    "check_request": "omnicore.engine.inputs:check_request",
    "resolve_roles": "omnicore.engine.inputs:resolve_roles",
    "check_inputs": "omnicore.engine.inputs:check_inputs",
    "check_extra": "omnicore.engine.inputs:check_extra",  # the declared ModelSpec.extra_fields (1.7)
    "parse_size_wh": "omnicore.sizes:parse_size_wh",  # "WIDTHxHEIGHT" -> (width, height) (1.7)
    # a stage a model runs besides the base loop (a refiner), listed in ``extra[STAGES_KEY]`` by its preprocess: held
    # to the same limits and counted into the job's work budget (1.4)
    "StageWork": "omnicore.engine.limits:StageWork",
    "STAGES_KEY": "omnicore.engine.limits:STAGES_KEY",
    # -- cancellation points inside a long stage (decode chunks) ---------------------------------------------
    "raise_if_cancelled": "omnicore.engine.cancellation:raise_if_cancelled",
    "cancel_points": "omnicore.engine.cancellation:cancel_points",
    "report_stage_progress": "omnicore.engine.stage_progress:report_stage_progress",
    # -- errors (name the field: ``InvalidRequest("params.height", "must be a multiple of 16")``) ----------
    "OmnicoreError": "omnicore.errors:OmnicoreError",
    "InvalidRequest": "omnicore.errors:InvalidRequest",
    "ConfigError": "omnicore.errors:ConfigError",
    "PluginError": "omnicore.errors:PluginError",
    "UnsupportedFeature": "omnicore.errors:UnsupportedFeature",
    "PlatformUnavailable": "omnicore.errors:PlatformUnavailable",
    "Cancelled": "omnicore.errors:Cancelled",
    # -- cache and offload declarations (see core/omnicore/cache/README.md) ---------------------------------
    "BlockLoop": "omnicore.blocks:BlockLoop",
    "TeaCacheAdapter": "omnicore.cache.teacache:TeaCacheAdapter",
    "hook_context": "omnicore.module_hooks:hook_context",
    "AdaLNProjection": "omnicore.cache.adaln_schedule:AdaLNProjection",
    "AdaLNScheduleController": "omnicore.cache.adaln_schedule:AdaLNScheduleController",
    "ABSENT": "omnicore.cache.adaln_schedule:ABSENT",  # adaln_step_index when no schedule step is given
    "STATE_STEP_KEY": "omnicore.cache.adaln_schedule:STATE_STEP_KEY",  # state.extras key of that step index
    "schedule_key": "omnicore.cache.adaln_schedule:schedule_key",
    "StepTimesteps": "omnicore.cache.adaln_schedule:StepTimesteps",
    "float32_bits": "omnicore.cache.adaln_schedule:float32_bits",
    "materialize": "omnicore.offload:materialize",  # load model-offloaded weights to run modules outside forward
    # -- writing a cache method ------------------------------------------------------------------------------
    "StepCache": "omnicore.cache._step:StepCache",
    "StepCacheConfig": "omnicore.cache._step:StepCacheConfig",
    "ModelHook": "omnicore.module_hooks:ModelHook",
    "register_hook": "omnicore.module_hooks:register_hook",
    "remove_hook": "omnicore.module_hooks:remove_hook",
    # -- writing a backend -----------------------------------------------------------------------------------
    "Platform": "omnicore.platforms.base:Platform",
    "PackedSequence": "omnicore.attention.packed:PackedSequence",
    "sdpa_attention": "omnicore.attention.reference:sdpa_attention",
    "AttentionMetadata": "omnicore.attention.metadata:AttentionMetadata",
    "AttentionSpan": "omnicore.attention.metadata:AttentionSpan",
    "packed_views": "omnicore.attention.inputs:packed_views",
    "check_packed": "omnicore.attention.inputs:check_packed",
    "OpSpec": "omnicore.specs:OpSpec",
    "OP_NAMES": "omnicore.ops.names:OP_NAMES",
    "ops": "omnicore.ops",  # the eager references (omnicore.ops.rms_norm ...); models call options.platform.ops
    "CacheHandle": "omnicore.hookspecs:CacheHandle",
    # -- running over a worker group (``--parallel``): sequence sharding and the CFG branches (1.5) ----------------
    "SequenceShard": "omnicore.parallel.ulysses:SequenceShard",
    "UlyssesAttention": "omnicore.parallel.ulysses:UlyssesAttention",
    "check_heads": "omnicore.parallel.ulysses:check_heads",
    "cfg_branches": "omnicore.parallel.cfg:cfg_branches",
    "data_parallel": "omnicore.parallel.cfg:data_parallel",
    "padded_length": "omnicore.parallel.ulysses:padded_length",
    # tensor parallelism (``tp=N``): the model's sharding plan, applied at load (shard-only checkpoint reads)
    "ShardRule": "omnicore.parallel.tensor_parallel:ShardRule",
    "TensorParallelPlan": "omnicore.parallel.tensor_parallel:TensorParallelPlan",
    "shard_module": "omnicore.parallel.tensor_parallel:shard_module",
    "parallelize": "omnicore.parallel.tensor_parallel:parallelize",
    "read_sharded_state_dict": "omnicore.parallel.tensor_parallel:read_sharded_state_dict",
    "sharded_parameter_bytes": "omnicore.parallel.tensor_parallel:sharded_parameter_bytes",
    "local_parameter_bytes": "omnicore.parallel.tensor_parallel:local_parameter_bytes",
    "local_ranges": "omnicore.parallel.tensor_parallel:local_ranges",
    "all_reduce_sum": "omnicore.parallel.collectives:all_reduce_sum",
    "all_gather_rows": "omnicore.parallel.collectives:all_gather_rows",
    # expert parallelism (``ep=N``): token dispatch/combine by all-to-all, the expert-count check
    "ExpertDispatch": "omnicore.parallel.experts:ExpertDispatch",
    "check_dispatch": "omnicore.parallel.experts:check_dispatch",
    "check_expert_degree": "omnicore.parallel.experts:check_expert_degree",
    "expert_bytes_per_layer": "omnicore.parallel.experts:expert_bytes_per_layer",
    # parallel VAE decode: tile decodes shared out round-robin over the ranks, gathered for the blend (1.7)
    "decode_tiles": "omnicore.parallel.vae_decode:decode_tiles",
    "parallel_vae_decode_enabled": "omnicore.parallel.vae_decode:parallel_vae_decode_enabled",
    "PARALLEL_VAE_DECODE_OPTION": "omnicore.parallel.vae_decode:PARALLEL_VAE_DECODE_OPTION",
    # a text encoder kept in host memory (``text_encoder_offload=cpu``), its rows shared from rank 0 (1.7)
    "TEXT_ENCODER_OFFLOAD_OPTION": "omnicore.parallel.host_text_encoder:TEXT_ENCODER_OFFLOAD_OPTION",
    "text_encoder_on_host": "omnicore.parallel.host_text_encoder:text_encoder_on_host",
    "holds_text_encoder": "omnicore.parallel.host_text_encoder:holds_text_encoder",
    "shared_encode": "omnicore.parallel.host_text_encoder:shared_encode",
    # -- request-gated VAE fast paths and the decode precision (docs/contracts-status.md C7) -----------
    "FastPathGate": "omnicore.vae_fast_paths:FastPathGate",
    "fast_path_gate": "omnicore.vae_fast_paths:fast_path_gate",
    "install_fast_path": "omnicore.vae_fast_paths:install_fast_path",
    "apply_decode_precision": "omnicore.vae_fast_paths:apply_decode_precision",
    # -- reading checkpoints: safetensors files, strict loading (errors name plugin, component, tensors) --------
    "CheckpointError": "omnicore.checkpoint:CheckpointError",
    "WeightMismatch": "omnicore.checkpoint:WeightMismatch",
    "read_json": "omnicore.checkpoint:read_json",
    "read_json_or_empty": "omnicore.checkpoint:read_json_or_empty",  # optional metadata: {} when absent (1.7)
    "weight_files": "omnicore.checkpoint:weight_files",
    "refuse_library_quantized": "omnicore.checkpoint:refuse_library_quantized",  # TorchAoConfig & co. (1.7)
    "read_state_dict": "omnicore.checkpoint:read_state_dict",
    "load_strict": "omnicore.checkpoint:load_strict",
    # -- tiny random-weight presets (byte_level_tokenizer needs tokenizers + transformers in the plugin) -------
    "init_visible_weights": "omnicore.tiny_checkpoints:init_visible_weights",
    "byte_level_tokenizer": "omnicore.tiny_checkpoints:byte_level_tokenizer",
    "ByteLevelTokenizer": "omnicore.tiny_checkpoints:ByteLevelTokenizer",
    # -- wrapping diffusers models ---------------------------------------------------------------------------
    "route_diffusers_attention": "omnicore.integrations.diffusers:route_diffusers_attention",
    # -- Qwen3-VL as a text encoder: loading (optionally the first N decoder layers) and the tiny presets' one (1.7)
    "load_qwen3_vl": "omnicore.integrations.qwen3_vl:load_qwen3_vl",
    "build_tiny_qwen3_vl": "omnicore.integrations.qwen3_vl:build_tiny_qwen3_vl",
    "QWEN_SPECIAL_TOKENS": "omnicore.integrations.qwen3_vl:QWEN_SPECIAL_TOKENS",
    "qwen3_vl_tp_plan": "omnicore.integrations.qwen3_vl:qwen3_vl_tp_plan",  # its decoder's TP plan (1.7)
    # -- per-request LoRA: the spec's target map, the request record, how packed rows map to samples ------------
    "LoRA": "omnicore.lora.records:LoRA",
    "LoRATargets": "omnicore.lora.records:LoRATargets",
    "LoRAError": "omnicore.lora.errors:LoRAError",
    "lora_packed_rows": "omnicore.lora.rows:lora_packed_rows",
    "lora_sample_rows": "omnicore.lora.rows:lora_sample_rows",
    "lora_base_only": "omnicore.lora.rows:lora_base_only",
}


# What mypy sees: the real objects behind every lazy name (kept in step with _LAZY by tests/core/test_plugin_api.py).
if TYPE_CHECKING:
    from . import ops as ops
    from .attention.inputs import check_packed as check_packed
    from .attention.inputs import packed_views as packed_views
    from .attention.metadata import AttentionMetadata as AttentionMetadata
    from .attention.metadata import AttentionSpan as AttentionSpan
    from .attention.packed import PackedSequence as PackedSequence
    from .attention.reference import sdpa_attention as sdpa_attention
    from .blocks import BlockLoop as BlockLoop
    from .cache._step import StepCache as StepCache
    from .cache._step import StepCacheConfig as StepCacheConfig
    from .cache.adaln_schedule import ABSENT as ABSENT
    from .cache.adaln_schedule import STATE_STEP_KEY as STATE_STEP_KEY
    from .cache.adaln_schedule import AdaLNProjection as AdaLNProjection
    from .cache.adaln_schedule import AdaLNScheduleController as AdaLNScheduleController
    from .cache.adaln_schedule import StepTimesteps as StepTimesteps
    from .cache.adaln_schedule import float32_bits as float32_bits
    from .cache.adaln_schedule import schedule_key as schedule_key
    from .cache.teacache import TeaCacheAdapter as TeaCacheAdapter
    from .checkpoint import CheckpointError as CheckpointError
    from .checkpoint import WeightMismatch as WeightMismatch
    from .checkpoint import load_strict as load_strict
    from .checkpoint import read_json as read_json
    from .checkpoint import read_json_or_empty as read_json_or_empty
    from .checkpoint import read_state_dict as read_state_dict
    from .checkpoint import refuse_library_quantized as refuse_library_quantized
    from .checkpoint import weight_files as weight_files
    from .engine.cancellation import cancel_points as cancel_points
    from .engine.cancellation import raise_if_cancelled as raise_if_cancelled
    from .engine.inputs import check_extra as check_extra
    from .engine.inputs import check_inputs as check_inputs
    from .engine.inputs import check_request as check_request
    from .engine.inputs import resolve_roles as resolve_roles
    from .engine.limits import STAGES_KEY as STAGES_KEY
    from .engine.limits import StageWork as StageWork
    from .engine.protocol import BasePipeline as BasePipeline
    from .engine.protocol import DenoiseState as DenoiseState
    from .engine.protocol import LoadOptions as LoadOptions
    from .engine.protocol import Pipeline as Pipeline
    from .engine.protocol import output_seeds as output_seeds
    from .engine.request import MAX_SEED as MAX_SEED
    from .engine.request import GenerationRequest as GenerationRequest
    from .engine.request import MediaInput as MediaInput
    from .engine.request import SamplingParams as SamplingParams
    from .engine.request import random_seed as random_seed
    from .engine.stage_progress import report_stage_progress as report_stage_progress
    from .errors import Cancelled as Cancelled
    from .errors import ConfigError as ConfigError
    from .errors import InvalidRequest as InvalidRequest
    from .errors import OmnicoreError as OmnicoreError
    from .errors import PlatformUnavailable as PlatformUnavailable
    from .errors import PluginError as PluginError
    from .errors import UnsupportedFeature as UnsupportedFeature
    from .hookspecs import CacheHandle as CacheHandle
    from .integrations.diffusers import route_diffusers_attention as route_diffusers_attention
    from .integrations.qwen3_vl import QWEN_SPECIAL_TOKENS as QWEN_SPECIAL_TOKENS
    from .integrations.qwen3_vl import build_tiny_qwen3_vl as build_tiny_qwen3_vl
    from .integrations.qwen3_vl import load_qwen3_vl as load_qwen3_vl
    from .integrations.qwen3_vl import qwen3_vl_tp_plan as qwen3_vl_tp_plan
    from .lora.errors import LoRAError as LoRAError
    from .lora.records import LoRA as LoRA
    from .lora.records import LoRATargets as LoRATargets
    from .lora.rows import lora_base_only as lora_base_only
    from .lora.rows import lora_packed_rows as lora_packed_rows
    from .lora.rows import lora_sample_rows as lora_sample_rows
    from .media import AudioClip as AudioClip
    from .media import VideoClip as VideoClip
    from .media import load_media as load_media
    from .module_hooks import ModelHook as ModelHook
    from .module_hooks import hook_context as hook_context
    from .module_hooks import register_hook as register_hook
    from .module_hooks import remove_hook as remove_hook
    from .offload import materialize as materialize
    from .ops.names import OP_NAMES as OP_NAMES
    from .outputs.output import Output as Output
    from .outputs.readers import read_image as read_image
    from .parallel.cfg import cfg_branches as cfg_branches
    from .parallel.cfg import data_parallel as data_parallel
    from .parallel.collectives import all_gather_rows as all_gather_rows
    from .parallel.collectives import all_reduce_sum as all_reduce_sum
    from .parallel.experts import ExpertDispatch as ExpertDispatch
    from .parallel.experts import check_dispatch as check_dispatch
    from .parallel.experts import check_expert_degree as check_expert_degree
    from .parallel.experts import expert_bytes_per_layer as expert_bytes_per_layer
    from .parallel.host_text_encoder import TEXT_ENCODER_OFFLOAD_OPTION as TEXT_ENCODER_OFFLOAD_OPTION
    from .parallel.host_text_encoder import holds_text_encoder as holds_text_encoder
    from .parallel.host_text_encoder import shared_encode as shared_encode
    from .parallel.host_text_encoder import text_encoder_on_host as text_encoder_on_host
    from .parallel.tensor_parallel import ShardRule as ShardRule
    from .parallel.tensor_parallel import TensorParallelPlan as TensorParallelPlan
    from .parallel.tensor_parallel import local_parameter_bytes as local_parameter_bytes
    from .parallel.tensor_parallel import local_ranges as local_ranges
    from .parallel.tensor_parallel import parallelize as parallelize
    from .parallel.tensor_parallel import read_sharded_state_dict as read_sharded_state_dict
    from .parallel.tensor_parallel import shard_module as shard_module
    from .parallel.tensor_parallel import sharded_parameter_bytes as sharded_parameter_bytes
    from .parallel.ulysses import SequenceShard as SequenceShard
    from .parallel.ulysses import UlyssesAttention as UlyssesAttention
    from .parallel.ulysses import check_heads as check_heads
    from .parallel.ulysses import padded_length as padded_length
    from .parallel.vae_decode import PARALLEL_VAE_DECODE_OPTION as PARALLEL_VAE_DECODE_OPTION
    from .parallel.vae_decode import decode_tiles as decode_tiles
    from .parallel.vae_decode import parallel_vae_decode_enabled as parallel_vae_decode_enabled
    from .platforms.base import Platform as Platform
    from .registration import model_plugin as model_plugin
    from .sizes import parse_size_wh as parse_size_wh
    from .specs import AttentionBackendSpec as AttentionBackendSpec
    from .specs import AttentionCapabilities as AttentionCapabilities
    from .specs import AttentionRequirement as AttentionRequirement
    from .specs import CacheMethodSpec as CacheMethodSpec
    from .specs import InputRole as InputRole
    from .specs import ModelCapabilities as ModelCapabilities
    from .specs import ModelOption as ModelOption
    from .specs import ModelSpec as ModelSpec
    from .specs import OpSpec as OpSpec
    from .specs import PlatformSpec as PlatformSpec
    from .specs import PresetSpec as PresetSpec
    from .specs import RequestDefaults as RequestDefaults
    from .tiny_checkpoints import ByteLevelTokenizer as ByteLevelTokenizer
    from .tiny_checkpoints import byte_level_tokenizer as byte_level_tokenizer
    from .tiny_checkpoints import init_visible_weights as init_visible_weights
    from .vae_fast_paths import FastPathGate as FastPathGate
    from .vae_fast_paths import apply_decode_precision as apply_decode_precision
    from .vae_fast_paths import fast_path_gate as fast_path_gate
    from .vae_fast_paths import install_fast_path as install_fast_path

_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["PLUGIN_API_VERSION", "hookimpl", *_LAZY]
