"""The public plugin API (``omnicore.plugin``) keeps every name it promised.

``PUBLIC_NAMES`` is the checked-in list. Removing or renaming a name breaks plugins, so it needs a major bump of
``PLUGIN_API_VERSION`` (and then this list is rewritten with ``API_MAJOR``); adding a name is a minor change
and goes into the list in the same commit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

API_MAJOR = 1

PUBLIC_NAMES = frozenset({
    "PLUGIN_API_VERSION", "hookimpl",
    # registration records
    "ModelSpec", "ModelCapabilities", "RequestDefaults", "PresetSpec", "PlatformSpec", "AttentionBackendSpec",
    "AttentionCapabilities", "AttentionRequirement", "CacheMethodSpec",
    # pipeline protocol
    "Pipeline", "BasePipeline", "DenoiseState", "LoadOptions", "output_seeds", "GenerationRequest",
    "SamplingParams", "Output", "read_image", "MAX_SEED", "random_seed",
    # media inputs, model options, cancellation points
    "MediaInput", "InputRole", "ModelOption", "VideoClip", "AudioClip", "load_media", "raise_if_cancelled",
    "cancel_points", "check_request", "resolve_roles", "check_inputs",
    # work of a model's own extra stage, checked with the request's limits (1.4)
    "StageWork", "STAGES_KEY",
    # running over a worker group (1.5)
    "SequenceShard", "UlyssesAttention", "check_heads", "cfg_branches", "data_parallel",
    "padded_length", "ShardRule", "TensorParallelPlan", "shard_module", "parallelize", "read_sharded_state_dict",
    "sharded_parameter_bytes", "local_parameter_bytes", "all_reduce_sum", "all_gather_rows", "local_ranges",
    # errors
    "OmnicoreError", "InvalidRequest", "ConfigError", "PluginError", "UnsupportedFeature", "PlatformUnavailable",
    "Cancelled",
    # caches and offload
    "BlockLoop", "TeaCacheAdapter", "hook_context", "AdaLNProjection", "AdaLNScheduleController", "ABSENT",
    "STATE_STEP_KEY", "schedule_key", "StepTimesteps", "float32_bits", "materialize",
    "StepCache", "StepCacheConfig", "ModelHook", "register_hook", "remove_hook",
    # backends
    "Platform", "PackedSequence", "sdpa_attention", "AttentionMetadata", "AttentionSpan", "OpSpec", "OP_NAMES", "ops",
    "CacheHandle", "packed_views", "check_packed",
    # request-gated VAE fast paths, decode precision
    "FastPathGate", "fast_path_gate", "install_fast_path", "apply_decode_precision",
    # wrapping diffusers
    "route_diffusers_attention",
    # reading checkpoints (1.1)
    "CheckpointError", "WeightMismatch", "read_json", "weight_files", "read_state_dict", "load_strict",
    # tiny random-weight presets
    "init_visible_weights", "byte_level_tokenizer", "ByteLevelTokenizer",
    # per-request LoRA (1.6)
    "LoRA", "LoRATargets", "LoRAError", "lora_packed_rows", "lora_sample_rows", "lora_base_only",
    # one plugin surface (1.7): the core checks a spec's declared extra fields
    "check_extra",
    # stage progress and expert parallel (1.7)
    "report_stage_progress", "ExpertDispatch", "check_dispatch", "check_expert_degree", "expert_bytes_per_layer",
    # parallel VAE decode (1.7)
    "decode_tiles", "parallel_vae_decode_enabled", "PARALLEL_VAE_DECODE_OPTION",
    # a text encoder in host memory, its rows shared from rank 0 (1.7)
    "TEXT_ENCODER_OFFLOAD_OPTION", "text_encoder_on_host", "holds_text_encoder", "shared_encode",
    # an entry module's plugin_info and registration hook derived from its specs (1.7)
    "model_plugin",
    # the one "WIDTHxHEIGHT" parser, (width, height) (1.7)
    "parse_size_wh",
    # Qwen3-VL as a text encoder and the tiny presets' one (1.7)
    "load_qwen3_vl", "build_tiny_qwen3_vl", "QWEN_SPECIAL_TOKENS", "qwen3_vl_tp_plan",
    # optional metadata files (1.7)
    "read_json_or_empty",
    # a component pre-quantized by diffusers / transformers (TorchAoConfig ...) refused by a raw-tensor loader (1.7)
    "refuse_library_quantized",
})


def test_every_promised_name_is_still_exported() -> None:
    import omnicore.plugin as api

    missing = sorted(PUBLIC_NAMES - set(api.__all__))
    assert not missing, (f"omnicore.plugin no longer exports {missing}: removing a public name needs a major "
                         f"bump of PLUGIN_API_VERSION (now {api.PLUGIN_API_VERSION})")
    for name in sorted(PUBLIC_NAMES):
        assert getattr(api, name) is not None, name


def test_new_names_are_added_to_the_list_deliberately() -> None:
    import omnicore.plugin as api

    unlisted = sorted(set(api.__all__) - PUBLIC_NAMES)
    assert not unlisted, f"{unlisted} are exported but not in PUBLIC_NAMES: add them (a minor API change)"


def test_major_version_matches_the_list() -> None:
    import omnicore

    major, minor = (int(p) for p in omnicore.PLUGIN_API_VERSION.split("."))
    assert major == API_MAJOR, "PLUGIN_API_VERSION changed major: rewrite PUBLIC_NAMES for the new contract"
    assert minor >= 0


def test_unknown_names_raise_attribute_error() -> None:
    import omnicore.plugin as api

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        api.NoSuchThing  # noqa: B018
    assert "BasePipeline" in dir(api)


def test_the_same_objects_as_their_home_modules() -> None:
    import omnicore.plugin as api
    from omnicore.engine.protocol import BasePipeline
    from omnicore.errors import InvalidRequest
    from omnicore.specs import ModelSpec

    assert (api.BasePipeline, api.InvalidRequest, api.ModelSpec) == (BasePipeline, InvalidRequest, ModelSpec)


def test_entry_module_names_import_without_torch() -> None:
    """What a plugin's entry module imports from here (hook marker, spec records, errors) never pulls in torch."""
    code = ("import sys\n"
            "from omnicore.plugin import (hookimpl, ModelSpec, ModelCapabilities, RequestDefaults, PresetSpec,\n"
            "    PlatformSpec, AttentionBackendSpec, AttentionCapabilities, CacheMethodSpec, InvalidRequest)\n"
            "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
