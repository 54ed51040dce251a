"""``confkv`` command line: ``confkv serve [flags]``, ``confkv version``; ``confkv-engine`` = serve.

The config is built once: the ``--config`` file (or defaults), then every flag given on the command
line overrides its field, then the whole document is validated. A bad config prints one clear
message and exits with status 2 before anything loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING

from pydantic import ValidationError

from confkv_api.config import ConfigError, ConfKVConfig, dump_config, load_config_file, with_overrides

if TYPE_CHECKING:
    from confkv_agent.launcher import AgentProcess

EXIT_BAD_CONFIG = 2

# flag dest -> (config section, snake_case field)
_OVERRIDES: dict[str, tuple[str, str]] = {
    "model": ("model", "source"),
    "served_name": ("model", "served_name"),
    "dtype": ("model", "dtype"),
    "weights": ("model", "weights"),
    "max_model_len": ("model", "max_model_len"),
    "host": ("engine", "host"),
    "port": ("engine", "port"),
    "device": ("engine", "device"),
    "max_batch_size": ("engine", "max_batch_size"),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens"),
    "prefill_chunk": ("engine", "prefill_chunk"),
    "max_waiting": ("engine", "max_waiting"),
    "api_key": ("engine", "api_key"),
    "grpc_socket": ("engine", "grpc_socket"),
    "max_cache_size": ("confkv", "max_cache_size"),
    "kv_policy": ("confkv", "kv_policy"),
    "kv_budget": ("confkv", "budget"),
    "kv_budget_tokens": ("confkv", "budget_tokens"),
}


def _version() -> str:
    try:
        return metadata.version("confkv")
    except metadata.PackageNotFoundError:
        return "unknown"


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", metavar="FILE",
        help="confkv.json (a file, or a directory holding one); flags override it")
    add("--model", help="builtin:smollm2-135m, a .gguf file or a Hugging Face model directory")
    add("--served-name", help="model name clients send (default: derived from the model)")
    add("--host", help="listen address (default 127.0.0.1)")
    add("--port", type=int, help="listen port (default 8000)")
    add("--device", choices=["auto", "cpu", "cuda"], help="default auto: cuda when available")
    add("--dtype", choices=["float32", "bfloat16", "float16"], help="weights and KV cache dtype")
    add("--weights", choices=["auto", "fp32", "bf16", "int8", "int4"],
        help="linear layers: auto (default: a quantized GGUF stays quantized on CPU), fp32, bf16, int8, int4")
    add("--max-model-len", type=int, help="context length cap (default: the model's)")
    add("--max-batch-size", type=int, help="sequences decoded together (default 64)")
    add("--max-num-batched-tokens", type=int, help="token budget of one engine step (default 2048)")
    add("--prefill-chunk", type=int, help="prompt tokens prefilled per step per sequence (default 512)")
    add("--max-waiting", type=int, help="requests allowed to wait before new ones get 429 (default 256)")
    add("--max-cache-size",
        help="KV pool size: bytes ('512Mi', '2G') or a fraction of device memory ('80%%')")
    add("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (env CONFKV_API_KEY)")
    add("--grpc-socket", metavar="PATH",
        help="Unix socket of the gRPC control plane (default /tmp/confkv/engine-PORT.sock)")
    add("--threads", type=int, help="torch CPU threads (env CONFKV_THREADS; default: all cores)")
    add("--kv-policy", choices=["full", "streaming", "h2o", "conf-kv"], help="KV retention policy")
    add("--kv-budget", type=float, metavar="F", help="per-sequence KV budget, fraction of the full cache")
    add("--kv-budget-tokens", type=int, metavar="N", help="per-sequence KV budget in tokens")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="confkv", description="CONF-KV inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    _serve_flags(serve_parser)
    serve_parser.add_argument("--with-agent", action="store_true",
                              help="also run confkv-agent (the sidecar) against this engine's control socket")
    sub.add_parser("version", help="print the version")
    return parser


def build_config(args: argparse.Namespace) -> ConfKVConfig:
    """The file (or defaults) with the given flags applied; raises ConfigError naming the problem."""
    config = load_config_file(args.config) if args.config else ConfKVConfig()
    if getattr(args, "api_key", None) is None and os.environ.get("CONFKV_API_KEY"):
        args.api_key = os.environ["CONFKV_API_KEY"]
    by_section: dict[str, dict[str, object]] = {}
    for dest, (section, name) in _OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            by_section.setdefault(section, {})[name] = value
    for section, values in by_section.items():
        try:
            config = with_overrides(config, section, **values)
        except ValidationError as err:
            problems = "; ".join(f"{section}.{'.'.join(map(str, e['loc'])) or '<section>'}: {e['msg']}"
                                 for e in err.errors())
            raise ConfigError(f"invalid command-line flags: {problems}") from None
    if config.confkv.budget is not None and config.confkv.budget_tokens is not None:
        raise ConfigError("set at most one of --kv-budget and --kv-budget-tokens")
    return config


def _announce(host: str, port: int) -> Callable[[str], None]:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{port}"

    def loaded(model: str) -> None:
        message = {"role": "user", "content": "What is the capital of France?"}
        body = json.dumps({"model": model, "messages": [message], "max_tokens": 32})
        print(f"\nCONF-KV is ready: {url}  (model {model!r})\n"
              f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{body}'\n"
              f"Metrics: {url}/metrics   Health: {url}/health   Stop: Ctrl-C\n", flush=True)
    print(f"CONF-KV engine starting on {url} (loading the model...)", flush=True)
    return loaded


def serve(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ConfigError as err:
        print(f"confkv: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from confkv_engine.core.async_engine import configure_torch_threads

    try:
        configure_torch_threads(args.threads)
    except ValueError as err:
        print(f"confkv: invalid --threads / CONFKV_THREADS: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from confkv_engine.http.server import run_server

    agent = _start_agent(args, config) if getattr(args, "with_agent", False) else None
    status = run_server(config, log_level=args.log_level,
                        on_loaded=_announce(config.engine.host, config.engine.port))
    if agent is not None:
        agent.stop()
    # Requests are drained and the engine thread is stopped; interpreter teardown (freeing the
    # model, torch's state) adds seconds to every pod termination and has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _start_agent(args: argparse.Namespace, config: ConfKVConfig) -> AgentProcess:
    """``--with-agent``: the agent gets the user's config file (live edits reach the engine), or, when
    flags changed the policy, a snapshot of the effective config (the file would undo the flags)."""
    import tempfile

    from confkv_agent.launcher import AgentProcess  # noqa: F811 - the runtime import of the hint

    path = args.config
    if path is None or any(getattr(args, d, None) is not None for d, (s, _) in _OVERRIDES.items()
                           if s == "confkv"):
        snapshot = tempfile.NamedTemporaryFile("w", suffix="-confkv.json", delete=False)  # noqa: SIM115
        with snapshot:
            json.dump(dump_config(config), snapshot)
        path = snapshot.name
    return AgentProcess(config.engine.control_socket, config_path=path,
                        remove_on_stop=None if path == args.config else path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(f"confkv {_version()}")
        return 0
    return serve(args)


def engine_main(argv: Sequence[str] | None = None) -> int:
    """``confkv-engine [serve flags]``: the container entrypoint (``serve`` without the subcommand)."""
    parser = argparse.ArgumentParser(prog="confkv-engine", description="CONF-KV inference engine server")
    _serve_flags(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
