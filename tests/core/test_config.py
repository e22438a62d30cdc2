"""Settings resolution: CLI flag > OMNICORE_* env var > default, with typed errors naming the setting."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
from omnicore.config import OPTIONS, Settings, finite_non_negative, resolve_settings
from omnicore.errors import ConfigError


def test_every_option_is_a_settings_field_with_the_same_default():
    fields = {f.name: f.default for f in attrs.fields(Settings)}
    assert set(fields) == {o.name for o in OPTIONS}
    for opt in OPTIONS:
        assert fields[opt.name] == opt.default, opt.name
        assert opt.env == "OMNICORE_" + ("CACHE" if opt.name == "cache_dir" else opt.name.upper())
    assert resolve_settings(env={}) == Settings()


def test_flag_beats_env_beats_default():
    assert resolve_settings(env={}).max_queue == 256
    assert resolve_settings(env={"OMNICORE_MAX_QUEUE": "9"}).max_queue == 9
    assert resolve_settings({"max_queue": 3}, env={"OMNICORE_MAX_QUEUE": "9"}).max_queue == 3
    assert resolve_settings({"max_queue": None}, env={"OMNICORE_MAX_QUEUE": "9"}).max_queue == 9  # unset flag


def test_reads_os_environ_when_no_env_given(monkeypatch):
    monkeypatch.setenv("OMNICORE_PLATFORM", "npu")
    assert resolve_settings().platform == "npu"


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_boolean_parsing(raw, expected):
    assert resolve_settings(env={"OMNICORE_TRACE_PLUGINS": raw}).trace_plugins is expected


def test_invalid_boolean_names_the_variable():
    with pytest.raises(ConfigError) as info:
        resolve_settings(env={"OMNICORE_TRACE_PLUGINS": "maybe"})
    assert info.value.name == "OMNICORE_TRACE_PLUGINS" and "'maybe'" in str(info.value)


def test_plugin_lists():
    assert resolve_settings(env={}).plugins is None  # unset: load everything
    assert resolve_settings(env={"OMNICORE_PLUGINS": ""}).plugins == ()  # set but empty: load nothing
    assert resolve_settings(env={"OMNICORE_PLUGINS": " a, b ,,c "}).plugins == ("a", "b", "c")
    assert resolve_settings(env={"OMNICORE_DISABLE_PLUGINS": "*"}).disable_plugins == ("*",)
    assert resolve_settings(env={"OMNICORE_DISABLE_PLUGINS": ""}).disable_plugins == ()


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "abc", "-0.001"])
def test_batch_wait_rejects_non_finite_and_negative(raw):
    with pytest.raises(ConfigError) as info:
        resolve_settings(env={"OMNICORE_REQUEST_BATCH_MAX_WAIT_MS": raw})
    assert info.value.name == "OMNICORE_REQUEST_BATCH_MAX_WAIT_MS"


def test_batch_wait_normalises_ints_to_float_and_flag_errors_name_the_flag():
    value = resolve_settings({"request_batch_max_wait_ms": 5}, env={}).request_batch_max_wait_ms
    assert value == 5.0 and isinstance(value, float)
    assert finite_non_negative("x", "0") == 0.0
    assert math.isclose(finite_non_negative("x", "2.5"), 2.5)
    with pytest.raises(ConfigError, match="--request-batch-max-wait-ms"):
        resolve_settings({"request_batch_max_wait_ms": float("nan")}, env={})


@pytest.mark.parametrize("raw", ["0", "-3", "two"])
def test_positive_ints(raw):
    with pytest.raises(ConfigError, match="OMNICORE_MAX_NUM_SEQS: must be a positive integer"):
        resolve_settings(env={"OMNICORE_MAX_NUM_SEQS": raw})


def test_unknown_flag_is_rejected():
    with pytest.raises(ConfigError) as info:
        resolve_settings({"max_qeue": 3}, env={})
    assert info.value.name == "max_qeue"


def test_cache_and_state_paths(tmp_path):
    s = resolve_settings(env={"OMNICORE_CACHE": str(tmp_path)})
    assert s.cache_path == tmp_path and s.state_path == tmp_path / "state"
    s = resolve_settings(env={"OMNICORE_CACHE": str(tmp_path), "OMNICORE_STATE_DIR": str(tmp_path / "jobs")})
    assert s.state_path == tmp_path / "jobs"
    assert resolve_settings(env={}).cache_path == Path.home() / ".cache" / "omnicore"


def test_empty_strings_mean_default_for_optional_names():
    s = resolve_settings(env={"OMNICORE_PLATFORM": " ", "OMNICORE_ATTENTION_BACKEND": "", "OMNICORE_API_KEY": ""})
    assert (s.platform, s.attention_backend, s.api_key) == (None, None, None)
    assert resolve_settings(env={"OMNICORE_LOG_LEVEL": "debug"}).log_level == "DEBUG"
