"""Settings resolution: CLI flag > OMNICORE_* env var > default, with typed errors naming the setting."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import attrs
import pytest
from omnicore.config import OPTIONS, SCOPES, Settings, finite_non_negative, resolve_settings
from omnicore.errors import ConfigError


def test_every_option_is_a_settings_attribute_with_the_same_default():
    defaults = Settings()
    assert set(defaults.as_dict()) == {o.name for o in OPTIONS}
    for opt in OPTIONS:
        assert getattr(defaults, opt.name) == opt.default, opt.name
        assert opt.env == "OMNICORE_" + ("CACHE" if opt.name == "cache_dir" else opt.name.upper())
        assert opt.scope in SCOPES, opt.name
    assert resolve_settings(env={}) == Settings()


def test_settings_are_read_only_values():
    s = Settings(max_queue=3)
    assert s.max_queue == 3 and s == Settings(max_queue=3) and hash(s) == hash(Settings(max_queue=3))
    assert s != Settings() and s.evolve(max_queue=256) == Settings()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.max_queue = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="max_qeue"):
        Settings(max_qeue=3)
    with pytest.raises(AttributeError, match="no setting"):
        _ = s.not_a_setting


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings}


@pytest.mark.parametrize(("command", "scopes"), [("generate", ("engine",)), ("serve", ("engine", "server"))])
def test_cli_flags_are_derived_from_options(command, scopes):
    """Every option of a scope has its flag on the subcommand, with the option's name as dest and its
    variable and default in the help; no other settings flag exists there."""
    from omnicore.cli.main import build_parser

    top = build_parser()
    flags = _flags(_subparser(top, command))
    expected = [o for o in OPTIONS if o.cli_flag and o.scope in scopes]
    for opt in expected:
        for flag in (opt.cli_flag, *opt.aliases):
            action = flags[flag]
            assert action.dest == opt.name and action.default is None, flag
            assert opt.env in action.help and opt.help.split(" (")[0][:30] in action.help, flag
    settings_dests = {a.dest for a in flags.values()} & {o.name for o in OPTIONS}
    assert settings_dests == {o.name for o in expected}
    assert _flags(top)["--log-level"].dest == "log_level"


def test_flag_errors_name_the_flag_that_exists():
    """The error for a bad value names the real flag (--heartbeat-interval, not --heartbeat-interval-s)."""
    with pytest.raises(ConfigError) as info:
        resolve_settings({"heartbeat_interval_s": "soon"}, env={})
    assert info.value.name == "--heartbeat-interval"
    with pytest.raises(ConfigError, match="^--job-ttl:"):
        resolve_settings({"job_ttl_s": -1}, env={})


def test_serve_flags_resolve_through_the_table(capsys):
    from omnicore.cli.main import build_parser
    from omnicore.config import flags_from_args

    args = build_parser().parse_args(["serve", "m", "--heartbeat-interval", "2", "--storage-dir", "/tmp/s",
                                      "--api-key", "a", "--api-key", "b", "--cors-origin", "x", "--max-queue", "7"])
    settings = resolve_settings(flags_from_args(args, "global", "engine", "server"), env={})
    assert (settings.heartbeat_interval_s, settings.state_dir, settings.api_key, settings.cors_origins,
            settings.max_queue) == (2.0, "/tmp/s", ("a", "b"), ("x",), 7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--heartbeat-interval", "nan"])
    assert "--heartbeat-interval: must be a finite non-negative number" in capsys.readouterr().err


def test_server_settings_are_derived_from_the_server_options(tmp_path):
    from omnicore.server.settings import SERVER_OPTIONS, ServerSettings, server_settings_from

    assert set(SERVER_OPTIONS) == {o.name for o in OPTIONS if o.scope == "server" and o.cli_flag} - {
        "api_key", "api_key_file", "admin_api_key", "state_dir"}
    ss = ServerSettings(state_dir=tmp_path)
    for name in SERVER_OPTIONS:
        assert getattr(ss, name) == getattr(Settings(), name), name
    keys = tmp_path / "keys"
    keys.write_text("k2\n\nk1\n")
    core = resolve_settings({"api_key": ["k1"], "api_key_file": str(keys), "max_work": 5}, env={})
    ss = server_settings_from(core)
    assert ss.api_keys == ("k1", "k2") and ss.max_work == 5 and ss.state_dir == core.state_path
    admin = server_settings_from(resolve_settings({"admin_api_key": ["boss-key"]}, env={}))
    assert admin.admin_api_keys == ("boss-key",) and "boss-key" not in repr(admin)  # keys never in a repr
    assert admin.api_keys == ("boss-key",)  # an admin key is an accepted key: auth is on
    with pytest.raises(TypeError, match="unknown setting"):
        ServerSettings(state_dir=tmp_path, max_num_seqs=2)  # an engine setting, not the server's


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
