"""``confkv`` command line: config file plus flag overrides, validated once; exit 2 on bad config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from confkv_api.config import ConfigError
from confkv_engine.cli import build_config, build_parser, main


def _config(argv: list[str]):
    return build_config(build_parser().parse_args(["serve", *argv]))


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "confkv.json"
    path.write_text(json.dumps({"engine": {"port": 9000, "maxBatchSize": 8, "maxWaiting": 3},
                                "confkv": {"maxCacheSize": "1Gi"}}))
    config = _config(["--config", str(path), "--max-batch-size", "4", "--dtype", "bfloat16",
                      "--kv-policy", "conf-kv", "--kv-budget", "0.5", "--max-cache-size", "256Mi"])
    assert config.engine.port == 9000 and config.engine.max_waiting == 3  # from the file
    assert config.engine.max_batch_size == 4 and config.model.dtype == "bfloat16"  # from flags
    assert config.confkv.kv_policy == "conf-kv" and config.confkv.budget == 0.5
    assert config.confkv.max_cache_size == "256Mi"


def test_kv_cache_dtype_flag_sets_the_confkv_field() -> None:
    assert _config([]).confkv.kv_cache_dtype == "auto"
    assert _config(["--kv-cache-dtype", "fp8"]).confkv.kv_cache_dtype == "fp8"
    assert _config(["--kv-cache-dtype", "int8"]).confkv.kv_cache_dtype == "int8"
    assert _config(["--dtype", "bfloat16", "--kv-cache-dtype", "float32"]).confkv.kv_cache_dtype == "float32"
    with pytest.raises(SystemExit):  # not one of the choices: argparse's usage error
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_kv_tiers_default_to_the_precision_chain_and_follow_a_coded_cache() -> None:
    assert _config(["--kv-policy", "conf-kv"]).confkv.tiers == ["full", "int4", "k4v2", "int2"]
    assert _config(["--kv-tiers", "full,key_only"]).confkv.tiers == ["full", "key_only"]
    # An fp8 pool holds codes already: the default chain there is FULL / KEY_ONLY, ...
    assert _config(["--kv-policy", "conf-kv", "--kv-cache-dtype", "fp8"]).confkv.tiers == ["full", "key_only"]
    # ... and a precision chain asked for on it is refused with what to use instead.
    with pytest.raises(ConfigError, match="holds codes already"):
        _config(["--kv-cache-dtype", "int8", "--kv-tiers", "full,int4,int2"])


def test_kv_budget_basis_flag_defaults_to_the_final_length() -> None:
    assert _config(["--kv-budget", "0.25"]).confkv.budget_basis == "final"
    assert _config(["--kv-budget", "0.25", "--kv-budget-basis", "length"]).confkv.budget_basis == "length"
    with pytest.raises(SystemExit):  # argparse refuses a basis it does not know (exit 2, usage)
        _config(["--kv-budget-basis", "peak"])


def test_enforce_eager_turns_cuda_graphs_off(tmp_path: Path) -> None:
    assert _config([]).engine.cuda_graphs is True
    assert _config(["--enforce-eager"]).engine.cuda_graphs is False
    path = tmp_path / "confkv.json"
    path.write_text(json.dumps({"engine": {"cudaGraphs": False}}))
    assert _config(["--config", str(path)]).engine.cuda_graphs is False  # the flag absent keeps the file's


def test_server_default_max_tokens_and_timeouts() -> None:
    assert _config([]).engine.max_tokens_default is None  # OpenAI's: the rest of the context
    assert _config(["--max-tokens-default", "256"]).engine.max_tokens_default == 256
    with pytest.raises(ConfigError):
        _config(["--max-tokens-default", "0"])
    args = build_parser().parse_args(["serve", "--drain-timeout", "2.5", "--header-timeout", "1"])
    assert (args.drain_timeout, args.header_timeout) == (2.5, 1.0)
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--drain-timeout", bad])


def test_config_directory_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "confkv.json").write_text(json.dumps({"model": {"servedName": "demo"}}))
    assert _config(["--config", str(tmp_path)]).model.served_name == "demo"
    assert _config([]).engine.max_batch_size == 64


@pytest.mark.parametrize("argv", [
    ["--max-batch-size", "0"],
    ["--kv-budget", "0.5", "--kv-budget-tokens", "64"],
    ["--max-cache-size", "lots"],
    ["--prefill-chunk", "4096"],  # above maxNumBatchedTokens
    ["--max-tokens-default", "-5"],
])
def test_bad_flags_raise_a_config_error(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        _config(argv)


def test_bad_config_exits_2_with_the_key_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"engine": {"maxBatchSise": 4}}))
    assert main(["serve", "--config", str(path)]) == 2
    assert "maxBatchSise" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.json")]) == 2


def test_model_that_cannot_load_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.gguf"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--model", str(missing),
                          "--port", str(port), "--grpc-socket", str(tmp_path / "c.sock")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
    assert str(missing) in out.stderr  # the error names the source it could not load


def test_version_and_usage_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "version"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.startswith("confkv ")
    bad = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--dtype", "int3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--dtype" in bad.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_engine_and_its_agent_exit_when_the_control_plane_cannot_start(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)  # another user's directory
    sock = str(theirs / "e.sock")
    env = {**os.environ, "CONFKV_AGENT_PORT": str(_free_port())}
    # A model path that does not exist: the engine must stop before it would even try to load it.
    out = subprocess.run([sys.executable, "-m", "confkv_engine.cli", "serve", "--model", str(tmp_path / "m"),
                          "--port", str(_free_port()), "--grpc-socket", sock, "--with-agent"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "control plane not started" in out.stderr and "owned by uid 4242" in out.stderr
    assert str(tmp_path / "m") not in out.stderr  # refused before the model load started
    left = [p for p in psutil.process_iter(["cmdline"]) if sock in (p.info["cmdline"] or [])]
    assert left == []  # the agent went with the engine


def test_served_model_name_list_gives_primary_and_aliases() -> None:
    config = _config(["--served-model-name", "main", "alias-a", "alias-b"])
    assert config.model.served_name == "main" and config.model.served_aliases == ["alias-a", "alias-b"]
    single = _config(["--served-name", "solo"])
    assert single.model.served_name == "solo" and single.model.served_aliases == []
