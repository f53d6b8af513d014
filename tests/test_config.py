"""Configuration: defaults, TOML loading, overrides, and errors that name the bad key."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from laneserve.server.config import (
    DEFAULT_LANES,
    MAX_CONFIG_BYTES,
    ConfigError,
    LaneConfig,
    ServerConfig,
    config_from_mapping,
    load_config,
)

LANE = """
[[lanes]]
name = "{name}"
capacity_rows = 64
timeout_ms = 500
max_wait_ms = 1
min_share = {min_share}
"""


def lane_toml(name: str = "fast", min_share: float = 0.0) -> str:
    return LANE.format(name=name, min_share=min_share)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "laneserve.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_valid() -> None:
    config = ServerConfig(model_path="model.onnx")
    assert [lane.name for lane in config.lanes] == ["interactive", "standard", "bulk"]
    assert config.lanes == DEFAULT_LANES
    assert config.default_lane == "standard"
    assert config.max_batch_size == 128
    assert config.device == "auto"
    assert sum(lane.min_share for lane in config.lanes) < 1
    assert load_config(None, model_path="model.onnx") == config
    assert config_from_mapping({}, model_path="model.onnx") == config


def test_toml_file_with_lanes_is_loaded(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
port = 0
max_batch_size = 64
default_lane = "slow"
device = "cpu"
drain_grace_s = 2.5

[[lanes]]
name = "fast"
capacity_rows = 32
timeout_ms = 250
max_wait_ms = 0
min_share = 0.0

[[lanes]]
name = "slow"
capacity_rows = 1024
timeout_ms = 60000
max_wait_ms = 10
min_share = 0.2
""",
    )
    config = load_config(path, model_path="model.onnx")
    assert config.model_path == "model.onnx"
    assert config.port == 0
    assert config.max_batch_size == 64
    assert config.default_lane == "slow"
    assert config.device == "cpu"
    assert config.drain_grace_s == 2.5
    assert config.lanes == (
        LaneConfig("fast", capacity_rows=32, timeout_ms=250, max_wait_ms=0, min_share=0.0),
        LaneConfig("slow", capacity_rows=1024, timeout_ms=60_000, max_wait_ms=10, min_share=0.2),
    )
    assert config.lane("slow").capacity_rows == 1024
    with pytest.raises(KeyError):
        config.lane("bulk")


def test_compressed_requests_are_taken_by_default_and_turned_off_by_the_file(
    tmp_path: Path,
) -> None:
    assert ServerConfig(model_path="model.onnx").compressed_requests is True
    path = write(tmp_path, "[server]\ncompressed_requests = false\n")
    assert load_config(path, model_path="model.onnx").compressed_requests is False


def test_keys_missing_from_the_file_keep_their_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[server]\nport = 9000\n"), model_path="m.onnx")
    assert config == ServerConfig(model_path="m.onnx", port=9000)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        pytest.param("[serve]\nport = 1\n", "serve", id="unknown-top-level-table"),
        pytest.param("[server]\nmax_batch = 4\n", "max_batch", id="unknown-server-key"),
        pytest.param("[server]\nlanes = 3\n", "lanes", id="lanes-inside-server"),
        pytest.param("server = 3\n", "server", id="server-not-a-table"),
        pytest.param(lane_toml() + "priority = 1\n", "priority", id="unknown-lane-key"),
        pytest.param(
            '[[lanes]]\nname = "fast"\ncapacity_rows = 4\ntimeout_ms = 5\nmin_share = 0.0\n',
            "max_wait_ms",
            id="missing-lane-key",
        ),
        pytest.param("lanes = 3\n", "lanes", id="lanes-not-an-array"),
        pytest.param("lanes = [3]\n", "lanes[0]", id="lane-not-a-table"),
        pytest.param("lanes = []\n", "lanes", id="no-lanes"),
        pytest.param('[server]\nport = "80"\n', "server.port", id="port-string"),
        pytest.param("[server]\nmax_batch_size = 1.5\n", "server.max_batch_size", id="float"),
        pytest.param('[server]\ndevice = "gpu"\n', "server.device", id="device"),
        pytest.param('[server]\ndrain_grace_s = "1"\n', "server.drain_grace_s", id="grace-str"),
        pytest.param(
            "[server]\nmax_batch_size = true\n", "server.max_batch_size", id="bool-batch-size"
        ),
        pytest.param("[server]\nport = false\n", "server.port", id="bool-port"),
        pytest.param(
            '[server]\ncompressed_requests = "false"\n',
            "server.compressed_requests: expected true or false, got 'false'",
            id="compressed-requests-string",
        ),
        pytest.param(
            "[server]\ncompressed_requests = 0\n",
            "server.compressed_requests: expected true or false, got 0",
            id="compressed-requests-int",
        ),
        pytest.param(
            "[server]\nmax_message_bytes = 2147483648\n",
            "server.max_message_bytes: expected an integer in [1024, 2147483647]",
            id="message-bytes-over-grpc-int",
        ),
        pytest.param(
            "[server]\nmax_pending_calls = 2147483648\n",
            "server.max_pending_calls",
            id="pending-calls-over-grpc-int",
        ),
        pytest.param(
            "[server]\nport = 9000\npriority_port = 9000\n",
            "server.priority_port",
            id="priority-port-same-as-port",
        ),
        pytest.param(
            "[server]\nport = 9000\nmetrics_port = 9000\n",
            "server.metrics_port: expected a port other than server.port, got 9000 for both",
            id="metrics-port-same-as-port",
        ),
        pytest.param(
            "[server]\npriority_port = 9001\nmetrics_port = 9001\n",
            "server.metrics_port: expected a port other than server.priority_port",
            id="metrics-port-same-as-priority-port",
        ),
        pytest.param(
            "[server]\npriority_port = -2\n", "server.priority_port", id="priority-port-negative"
        ),
        pytest.param("[server]\ndrain_grace_s = true\n", "server.drain_grace_s", id="bool-grace"),
        pytest.param(
            "[server]\nintra_op_threads = true\n", "server.intra_op_threads", id="bool-threads"
        ),
        pytest.param(
            lane_toml().replace("timeout_ms = 500", "timeout_ms = true"),
            "timeout_ms",
            id="bool-lane-timeout",
        ),
        pytest.param(
            lane_toml().replace("capacity_rows = 64", 'capacity_rows = "64"'),
            "capacity_rows",
            id="string-capacity",
        ),
        pytest.param(
            lane_toml().replace("min_share = 0.0", 'min_share = "0.1"'),
            "min_share",
            id="string-share",
        ),
        pytest.param(
            lane_toml().replace("min_share = 0.0", "min_share = true"),
            "min_share",
            id="bool-share",
        ),
        pytest.param("[server]\nmax_batch_size = 0\n", "server.max_batch_size", id="zero-cap"),
        pytest.param("[server]\nmax_batch_size = -1\n", "server.max_batch_size", id="neg-cap"),
        pytest.param("[server]\nport = -1\n", "server.port", id="negative-port"),
        pytest.param("[server]\nport = 70000\n", "server.port", id="port-too-large"),
        pytest.param(
            "[server]\nintra_op_threads = -1\n", "server.intra_op_threads", id="neg-threads"
        ),
        pytest.param(
            "[server]\nmax_message_bytes = 10\n", "server.max_message_bytes", id="tiny-message"
        ),
        pytest.param("[server]\ndrain_grace_s = -1.0\n", "server.drain_grace_s", id="neg-grace"),
        pytest.param(
            "[server]\ndrain_grace_s = 1e10\n",
            "server.drain_grace_s: expected seconds in [0, 3600]",
            id="grace-past-thread-timeouts",
        ),
        pytest.param(
            lane_toml().replace("timeout_ms = 500", "timeout_ms = 10000000000000"),
            "timeout_ms: expected an integer in [1, 4294967295]",
            id="lane-timeout-over-uint32",
        ),
        pytest.param(
            lane_toml().replace("capacity_rows = 64", "capacity_rows = 4294967296"),
            "capacity_rows: expected an integer in [1, 4294967295]",
            id="capacity-over-uint32",
        ),
        pytest.param(
            "[server]\nmax_batch_size = 4294967296\n",
            "server.max_batch_size: expected an integer in [1, 4294967295]",
            id="batch-size-over-uint32",
        ),
        pytest.param(
            "[server]\nstream_window = 4294967296\n",
            "server.stream_window: expected an integer in [1, 4294967295]",
            id="stream-window-over-uint32",
        ),
        pytest.param(
            "[server]\nstream_answer_buffer_bytes = 0\n",
            "server.stream_answer_buffer_bytes: expected an integer >= 1",
            id="stream-answer-buffer-zero",
        ),
        pytest.param(
            "[server]\nreceive_window_bytes = 2147483648\n",
            "server.receive_window_bytes: expected an integer in [0, 2147483647]",
            id="receive-window-over-http2",
        ),
        pytest.param(
            "[server]\nreceive_window_bytes = -1\n",
            "server.receive_window_bytes: expected an integer in [0, 2147483647]",
            id="receive-window-negative",
        ),
        pytest.param(
            "[server]\nreceive_window_bytes = 4096\n",
            "server.receive_window_bytes: expected 0 (gRPC's own sizing) or 65535 to "
            "2147483647 bytes, got 4096",
            id="receive-window-under-http2s-default",
        ),
        pytest.param(
            "[server]\nintra_op_threads = 2147483648\n",
            "server.intra_op_threads: expected an integer in [0, 1024]",
            id="threads-over-c-int",
        ),
        pytest.param(
            '[server]\nmemory_limit = "99999999999999999999TiB"\n',
            "server.memory_limit (--memory-limit): memory limit '99999999999999999999TiB': "
            "expected at most 1024TiB (1 PiB)",
            id="memory-limit-over-64-bits",
        ),
        pytest.param(
            "[server]\nbatch_cap = 256\n",
            "server.batch_cap: expected at most server.max_batch_size (128), got 256; raise "
            "max_batch_size (--max-batch-size) for a larger cap",
            id="batch-cap-over-the-default-max-batch-size",
        ),
        pytest.param(
            "[server]\nmemory_limit = 0.9\n",
            "server.memory_limit: expected a string like '6GiB', or a fraction of device "
            "memory such as '0.9', got 0.9",
            id="memory-limit-as-a-number",
        ),
        pytest.param(
            "[server]\nmax_pending_calls = 0\n", "server.max_pending_calls", id="no-pending-calls"
        ),
        pytest.param(
            "[server]\npriority_max_pending_calls = 0\n",
            "server.priority_max_pending_calls",
            id="no-priority-pending-calls",
        ),
        pytest.param(
            lane_toml().replace("capacity_rows = 64", "capacity_rows = 0"),
            "capacity_rows",
            id="zero-capacity",
        ),
        pytest.param(
            lane_toml().replace("timeout_ms = 500", "timeout_ms = 0"),
            "timeout_ms",
            id="zero-timeout",
        ),
        pytest.param(
            lane_toml().replace("max_wait_ms = 1", "max_wait_ms = -1"),
            "max_wait_ms",
            id="negative-max-wait",
        ),
        pytest.param(lane_toml(min_share=-0.1), "min_share", id="negative-share"),
        pytest.param(lane_toml(min_share=1.0), "min_share", id="share-of-one"),
        pytest.param(
            lane_toml().replace("min_share = 0.0", "min_share = nan"), "min_share", id="nan-share"
        ),
        pytest.param(
            '[server]\ndefault_lane = "a"\n' + lane_toml("a", 0.5) + lane_toml("b", 0.5),
            "min_share",
            id="shares-sum-to-one",
        ),
        pytest.param(lane_toml("a") + lane_toml("a"), "names must be unique", id="dup-lanes"),
        pytest.param(lane_toml("a b"), "name", id="bad-lane-name"),
        pytest.param(
            '[server]\ndefault_lane = "express"\n', "server.default_lane", id="default-lane"
        ),
        pytest.param(
            '[server]\ntls_cert = "server.pem"\n', "server.tls_cert, server.tls_key", id="no-key"
        ),
        pytest.param('[server]\ntls_client_ca = "ca.pem"\n', "server.tls_client_ca", id="ca-alone"),
        pytest.param('[server]\ntls_key = ""\n', "server.tls_key", id="empty-key-path"),
        pytest.param(
            lane_toml("fast"), "server.default_lane", id="default-lane-not-among-new-lanes"
        ),
    ],
)
def test_invalid_config_is_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(write(tmp_path, text), model_path="model.onnx")


def test_lanes_without_the_default_lane_say_that_default_lane_must_be_set(
    tmp_path: Path,
) -> None:
    """The file never said "standard": the error must say where it came from."""
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, lane_toml("interactive")), model_path="model.onnx")
    assert str(refused.value) == (
        "server.default_lane: expected one of ['interactive'], got 'standard' ('standard' is "
        "the default of server.default_lane; with [[lanes]] that have no lane of that name, "
        "set default_lane in [server] to one of them)"
    )
    text = '[server]\ndefault_lane = "express"\n' + lane_toml("interactive")
    with pytest.raises(ConfigError) as named:
        load_config(write(tmp_path, text), model_path="model.onnx")
    assert str(named.value) == (
        "server.default_lane: expected one of ['interactive'], got 'express'"
    ), "a name the file gave needs no explanation"


def test_a_config_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[server]\nhost = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {re.escape(str(path))}: not UTF-8"):
        load_config(path, model_path="model.onnx")


def test_a_config_file_that_is_absent_or_not_toml_is_refused_saying_what_was_expected(
    tmp_path: Path,
) -> None:
    absent = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(absent, model_path="model.onnx")
    assert str(caught.value) == (
        f"config file {absent}: No such file or directory; expected a readable TOML file"
    )
    broken = write(tmp_path, "[server\n")
    with pytest.raises(ConfigError, match=r"; expected valid TOML$"):
        load_config(broken, model_path="model.onnx")


def test_a_config_path_that_is_a_device_or_too_large_is_refused(tmp_path: Path) -> None:
    """/dev/zero was read until memory ran out (a MemoryError traceback): refused, naming
    the file. A pipe is read (`--config <(envsubst < t.toml)`), a byte-order mark, which
    editors on Windows write, read past."""
    with pytest.raises(ConfigError) as caught:
        load_config("/dev/zero", model_path="model.onnx")
    assert str(caught.value) == ("config file /dev/zero: a device; expected a readable TOML file")
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match=rf"over {MAX_CONFIG_BYTES} bytes; expected a TOML"):
        load_config(huge, model_path="model.onnx")
    marked = tmp_path / "marked.toml"
    marked.write_bytes(b"\xef\xbb\xbf[server]\nmax_batch_size = 8\n")
    assert load_config(marked, model_path="model.onnx").max_batch_size == 8
    read, write = os.pipe()
    os.write(write, b"[server]\nmax_batch_size = 4\n")
    os.close(write)
    try:
        assert load_config(f"/dev/fd/{read}", model_path="model.onnx").max_batch_size == 4
    finally:
        os.close(read)


def test_shares_summing_to_one_report_the_sum(tmp_path: Path) -> None:
    text = '[server]\ndefault_lane = "a"\n' + lane_toml("a", 0.5) + lane_toml("b", 0.5)
    with pytest.raises(ConfigError, match=r"lanes: min_share must sum to less than 1, got 1"):
        load_config(write(tmp_path, text), model_path="model.onnx")


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nmax_batch_size = = 3\n")
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path, model_path="model.onnx")


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path, model_path="model.onnx")


def test_overrides_win_over_the_file_and_none_means_unset(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 9000\nmax_batch_size = 64\n")
    config = load_config(
        path,
        model_path="model.onnx",
        overrides={"port": 0, "max_batch_size": None, "device": "cpu", "host": None},
    )
    assert config.port == 0
    assert config.max_batch_size == 64
    assert config.device == "cpu"
    assert config.host == "127.0.0.1"


def test_overrides_apply_without_a_file() -> None:
    config = config_from_mapping(
        {}, model_path="model.onnx", overrides={"drain_grace_s": 0.5, "port": None}
    )
    assert config == ServerConfig(model_path="model.onnx", drain_grace_s=0.5)


def test_overrides_are_validated_like_the_file() -> None:
    with pytest.raises(ConfigError, match=re.escape("server.max_batch_size")):
        config_from_mapping({}, model_path="model.onnx", overrides={"max_batch_size": 0})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        pytest.param({"max_batch_size": 0}, "server.max_batch_size", id="integer-range"),
        pytest.param({"port": "80"}, "server.port", id="integer-type"),
        pytest.param({"batch_cap": 256}, "server.batch_cap", id="over-max-batch-size"),
        pytest.param({"drain_grace_s": math.nan}, "server.drain_grace_s", id="seconds"),
        pytest.param({"metrics_port": 50051}, "server.metrics_port", id="port-taken"),
        pytest.param({"host": ""}, "server.host", id="host"),
    ],
)
def test_a_refusal_of_one_settings_value_carries_its_key_for_a_flag_to_name(
    overrides: dict[str, object], key: str
) -> None:
    """The command line names the flag that gave a refused value by this key
    (`ConfigError.naming`): `--max-batch-size 0` was refused as server.max_batch_size."""
    with pytest.raises(ConfigError) as refused:
        config_from_mapping({}, model_path="model.onnx", overrides=overrides)
    assert refused.value.key == key
    problem = str(refused.value).removeprefix(f"{key}: ")
    assert problem != str(refused.value)
    named = refused.value.naming("--a-flag")
    assert str(named) == f"--a-flag: {problem}"
    assert named.key == "--a-flag"


def test_a_refusal_of_several_settings_carries_no_key() -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_mapping({}, model_path="model.onnx", overrides={"tls_cert": "cert.pem"})
    assert str(refused.value).startswith("server.tls_cert, server.tls_key: expected both")
    assert refused.value.key is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        pytest.param(
            {"host_memory_limit": "100"},
            "server.host_memory_limit (--host-memory-limit): memory limit '100' is 100 bytes; "
            "expected at least 1MiB",
            id="host-bytes-under-1mib",
        ),
        pytest.param(
            {"host_memory_limit": "0.5"},
            "server.host_memory_limit (--host-memory-limit): memory limit '0.5': expected "
            "bytes like 6GiB, not a fraction",
            id="host-fraction",
        ),
        pytest.param(
            {"host_memory_limit": "lots"},
            "server.host_memory_limit (--host-memory-limit): memory limit 'lots': expected "
            "bytes like 6GiB",
            id="host-not-a-size",
        ),
        pytest.param(
            {"memory_limit": "100"},
            "server.memory_limit (--memory-limit): memory limit '100' is 100 bytes; expected "
            "at least 1MiB, or a fraction of device memory in (0, 1] such as 0.9",
            id="device-bytes-under-1mib",
        ),
        pytest.param(
            {"memory_limit": "1XB"},
            "server.memory_limit (--memory-limit): memory limit '1XB': unknown unit 'XB'; "
            "expected no unit (bytes) or one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, k, m, "
            "g, t (any case)",
            id="unknown-unit",
        ),
    ],
)
def test_a_refused_memory_size_offers_only_the_forms_its_key_accepts(
    settings: dict[str, str], message: str
) -> None:
    """host_memory_limit = '100' was told "or a fraction of device memory such as 0.9",
    which host_memory_limit refuses, and an unknown unit listed KiB, MiB, GiB alone."""
    with pytest.raises(ConfigError) as from_the_file:
        config_from_mapping({"server": settings}, model_path="model.onnx")
    assert str(from_the_file.value) == message
    with pytest.raises(ConfigError) as from_a_flag:
        config_from_mapping({}, model_path="model.onnx", overrides=settings)
    assert str(from_a_flag.value) == message


def test_memory_sizes_take_terabytes_as_they_take_gigabytes() -> None:
    config = config_from_mapping(
        {}, model_path="model.onnx", overrides={"memory_limit": "1TB", "host_memory_limit": "2t"}
    )
    assert (config.memory_limit, config.host_memory_limit) == ("1TB", "2t")


def test_lane_name_that_is_not_a_string_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Named by its index: the error said lanes[5].name, as if of a sixth lane."""
    text = lane_toml().replace('name = "fast"', "name = 5")
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, text), model_path="model.onnx")
    assert str(refused.value) == (
        "lanes[0].name: expected a string of letters, digits, '-' and '_', at least one a "
        "letter or digit, got 5"
    )


@pytest.mark.parametrize("name", ["-", "_", "--", "a b"])
def test_a_lane_name_is_refused_saying_what_it_lacks(tmp_path: Path, name: str) -> None:
    """'-' was refused "expected letters, digits, '-' or '_'": the rule it broke (at
    least one letter or digit) went unsaid."""
    text = lane_toml().replace('name = "fast"', f'name = "{name}"')
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, text), model_path="model.onnx")
    assert str(refused.value) == (
        f"lanes[{name!r}].name: expected letters, digits, '-' and '_', at least one a letter "
        f"or digit, got {name!r}"
    )


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_drain_grace_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("server.drain_grace_s")):
        load_config(write(tmp_path, f"[server]\ndrain_grace_s = {value}\n"), model_path="m")


def test_host_that_is_not_a_string_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("server.host")):
        load_config(write(tmp_path, "[server]\nhost = 5\n"), model_path="m")


def test_unknown_override_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="overrides: unknown key"):
        config_from_mapping({}, model_path="m", overrides={"batch": 4})


def test_probe_shapes_from_the_file_and_refused_when_not_sizes() -> None:
    document = {"server": {"probe_shapes": {"image": [3, 224, 224]}}}
    config = config_from_mapping(document, model_path="m")
    assert config.probe_shapes == {"image": (3, 224, 224)}
    for bad in ({"image": "3,224"}, {"image": [3, 0]}, {"image": [3.5]}, [3, 224]):
        with pytest.raises(ConfigError, match=r"server\.probe_shapes: expected a table"):
            config_from_mapping({"server": {"probe_shapes": bad}}, model_path="m")


def test_a_probe_shape_flag_keeps_the_files_shapes_of_other_inputs() -> None:
    document = {"server": {"probe_shapes": {"a": [1, 8, 8], "b": [1, 8, 8]}}}
    config = config_from_mapping(
        document, model_path="m", overrides={"probe_shapes": {"a": [1, 16, 16]}}
    )
    assert config.probe_shapes == {"a": (1, 16, 16), "b": (1, 8, 8)}


@pytest.mark.parametrize(
    "in_the_file",
    [
        pytest.param('"x"', id="not-a-table"),
        pytest.param("{ input = [0] }", id="bad-sizes-of-the-flags-input"),
    ],
)
def test_a_mistyped_probe_shapes_in_the_file_is_refused_beside_a_probe_shape_flag(
    tmp_path: Path, in_the_file: str
) -> None:
    """Merged only when the file's value was a table, and then by input: the flag's
    replaced a mistyped value (or the same input's bad sizes) unchecked."""
    path = write(tmp_path, f"[server]\nprobe_shapes = {in_the_file}\n")
    with pytest.raises(
        ConfigError,
        match=r"^server\.probe_shapes: expected a table of input name = \[dimension, \.\.\.\]",
    ):
        load_config(path, model_path="m", overrides={"probe_shapes": {"input": [512]}})


def test_drain_delay_defaults_to_zero_and_is_read_from_the_file(tmp_path: Path) -> None:
    assert ServerConfig(model_path="m").drain_delay_s == 0.0
    config = load_config(write(tmp_path, "[server]\ndrain_delay_s = 5\n"), model_path="m")
    assert config.drain_delay_s == 5


@pytest.mark.parametrize(
    ("value", "shown"),
    [("-1.0", "-1.0"), ("true", "True"), ('"5"', "'5'"), ("inf", "inf"), ("3601", "3601")],
)
def test_a_drain_delay_out_of_range_is_refused_naming_the_key(
    tmp_path: Path, value: str, shown: str
) -> None:
    path = write(tmp_path, f"[server]\ndrain_delay_s = {value}\n")
    expected = f"server.drain_delay_s: expected seconds in [0, 3600], got {shown}"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        load_config(path, model_path="m")


MODEL_NAME_RULE = (
    "expected 1 to 256 bytes of UTF-8 text, without control characters or whitespace at either end"
)


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ('""', "''"),
        ("3", "3"),
        ('" mlp"', "' mlp'"),
        ('"mlp\\u3000"', "'mlp\\u3000'"),  # an ideographic space
        ('"nl\\nname"', "'nl\\nname', which holds the control character '\\n'"),
        ('"a\\u0085b"', "'a\\x85b', which holds the control character '\\x85'"),
        (f'"{"m" * 257}"', f"257 bytes (starting {'m' * 32!r})"),
        (f'"{"é" * 129}"', f"258 bytes (starting {'é' * 32!r})"),
    ],
)
def test_a_model_name_is_refused_saying_what_names_are_allowed(
    tmp_path: Path, value: str, got: str
) -> None:
    """A 70 000-byte name, one holding a newline and one padded with spaces were taken, to
    be matched by no client's call (or to make every ModelInfer answer 70 KB larger). The
    words fit the flag as well as the key: --model-name had been told "or no key"."""
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, f"[server]\nmodel_name = {value}\n"), model_path="m")
    assert str(refused.value) == f"server.model_name: {MODEL_NAME_RULE}, got {got}"
    flag = refused.value.naming("--model-name")
    assert str(flag) == f"--model-name: {MODEL_NAME_RULE}, got {got}"


def test_a_model_name_that_is_not_utf8_is_refused() -> None:
    """An argument's bytes that are not UTF-8 reach Python as lone surrogates."""
    with pytest.raises(ConfigError) as refused:
        ServerConfig(model_path="m.onnx", model_name="ab\udcff")
    assert str(refused.value) == (
        f"server.model_name: {MODEL_NAME_RULE}, got 'ab\\udcff', which is not UTF-8"
    )


@pytest.mark.parametrize(
    ("model_path", "got"),
    [
        ("models/ lead.onnx", "' lead'"),
        ("models/lead\t.onnx", "'lead\\t', which holds the control character '\\t'"),
        ("", "''"),
    ],
)
def test_a_model_files_stem_that_is_no_name_to_serve_is_refused_unless_one_is_set(
    model_path: str, got: str
) -> None:
    """Without server.model_name the model file's stem is the name served, held to the
    same rule: a file " lead.onnx" was served as " lead", a name no log shows whole."""
    with pytest.raises(ConfigError) as refused:
        ServerConfig(model_path=model_path)
    assert str(refused.value) == (
        "server.model_name: not set, and the model file's name without its suffix is not a "
        f"name to serve: {MODEL_NAME_RULE}, got {got}; set a name for KServe and Triton "
        "clients to call the model by"
    )
    assert str(refused.value.naming("--model-name")).startswith("--model-name: not set, ")
    assert ServerConfig(model_path=model_path, model_name="lead").served_model_name == "lead"


@pytest.mark.parametrize("name", ["m", "m" * 256, "é" * 128, "resnet 50/v2.1", "a\u00a0b"])
def test_a_model_name_of_up_to_256_utf8_bytes_is_served_as_given(name: str) -> None:
    assert ServerConfig(model_path="m.onnx", model_name=name).served_model_name == name
    assert ServerConfig(model_path="models/demo.onnx").served_model_name == "demo"
