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
from confkv_engine.parallel.topology import (
    DEFAULT_JOIN_TIMEOUT_SECONDS,
    DEFAULT_MASTER_PORT,
    Topology,
    TopologyError,
)

if TYPE_CHECKING:
    from confkv_agent.launcher import AgentProcess

EXIT_BAD_CONFIG = 2
EXIT_NO_DEVICE = 3  # device: cuda asked for, no usable CUDA device (a pod's restart says why)
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes shows it in the container's terminated state

# flag dest -> (config section, snake_case field)
_OVERRIDES: dict[str, tuple[str, str]] = {
    "model": ("model", "source"),
    "served_name": ("model", "served_name"),
    "served_aliases": ("model", "served_aliases"),
    "dtype": ("model", "dtype"),
    "weights": ("model", "weights"),
    "compile": ("model", "compile"),
    "max_model_len": ("model", "max_model_len"),
    "host": ("engine", "host"),
    "port": ("engine", "port"),
    "device": ("engine", "device"),
    "max_batch_size": ("engine", "max_batch_size"),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens"),
    "prefill_chunk": ("engine", "prefill_chunk"),
    "max_waiting": ("engine", "max_waiting"),
    "max_tokens_default": ("engine", "max_tokens_default"),
    "api_key": ("engine", "api_key"),
    "grpc_socket": ("engine", "grpc_socket"),
    "cache_dir": ("engine", "cache_dir"),
    "tensor_parallel": ("engine", "tensor_parallel"),
    "cuda_graphs": ("engine", "cuda_graphs"),
    "max_cache_size": ("confkv", "max_cache_size"),
    "kv_cache_dtype": ("confkv", "kv_cache_dtype"),
    "kv_policy": ("confkv", "kv_policy"),
    "kv_budget": ("confkv", "budget"),
    "kv_budget_tokens": ("confkv", "budget_tokens"),
    "kv_budget_basis": ("confkv", "budget_basis"),
    "kv_tiers": ("confkv", "tiers"),
}


def _version() -> str:
    try:
        return metadata.version("confkv")
    except metadata.PackageNotFoundError:
        return "unknown"


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < 86400:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 86400), got {text!r}")
    return value


def _tier_list(text: str) -> list[str]:
    """--kv-tiers full,int4,int2 -> ["full", "int4", "int2"] (validated with the rest of the config)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--config", metavar="FILE",
        help="confkv.json (a file, or a directory holding one); flags override it")
    add("--model", help="builtin:smollm2-135m, builtin:gemma3-270m (optional package), a .gguf file "
        "or a Hugging Face model directory")
    add("--served-name", "--served-model-name", nargs="+", metavar="NAME",
        help="model name(s) clients may send; responses carry the first, /v1/models lists all "
             "(default: derived from the model)")
    add("--host", help="listen address (default 127.0.0.1)")
    add("--port", type=int, help="listen port (default 8000)")
    add("--device", choices=["auto", "cpu", "cuda"],
        help="default auto: cuda when a CUDA device is usable, else cpu; cuda without one is an error")
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype (and the KV cache's with --kv-cache-dtype auto); "
             "auto (default): bfloat16 on CUDA (float16 without bf16), float32 on CPU")
    add("--weights", choices=["auto", "fp32", "bf16", "int8", "int4"],
        help="linear layers: auto (default: a quantized GGUF stays quantized on CPU), fp32, bf16, int8, int4")
    add("--compile", action="store_const", const=True,
        help="torch.compile the elementwise blocks at start-up (model.compile; compile time is logged)")
    add("--max-model-len", type=int, help="context length cap (default: the model's)")
    add("--max-batch-size", type=int, help="sequences decoded together (default 64)")
    add("--max-num-batched-tokens", type=int, help="token budget of one engine step (default 2048)")
    add("--prefill-chunk", type=int, help="prompt tokens prefilled per step per sequence (default 512)")
    add("--enforce-eager", dest="cuda_graphs", action="store_const", const=False,
        help="on CUDA, run every decode step eagerly instead of replaying CUDA graphs captured at "
             "padded batch sizes 1, 2, 4, 8, 16, 32, ... (engine.cudaGraphs false)")
    add("--max-waiting", type=int, help="requests allowed to wait before new ones get 429 (default 256)")
    add("--max-tokens-default", type=int, metavar="N",
        help="max_tokens of a chat completion that sends none (default: the rest of the context, as OpenAI)")
    add("--max-cache-size",
        help="KV pool size: bytes ('512Mi', '2G') or a fraction of TOTAL device memory ('80%%', as "
             "vLLM's gpu_memory_utilization): the pool gets that share less the weights, the profiled "
             "activation peak and a reserve")
    add("--kv-cache-dtype", choices=["auto", "bfloat16", "float16", "float32", "int8", "fp8"],
        help="KV pool storage dtype (as vLLM): auto (default) = --dtype; fp8 = float8 e4m3, scale 1.0; "
             "int8 = symmetric with an fp16 scale per token and KV head")
    add("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (env CONFKV_API_KEY)")
    add("--grpc-socket", metavar="PATH",
        help="absolute path of the gRPC control plane's Unix socket (default engine-PORT.sock in "
             "$XDG_RUNTIME_DIR/confkv, else ~/.cache/confkv)")
    add("--threads", type=int,
        help="torch intra-op CPU threads (env CONFKV_THREADS; default: the usable cores, less one "
             "for the HTTP and control threads from 4 cores on)")
    add("--kv-policy", choices=["full", "streaming", "h2o", "conf-kv"], help="KV retention policy")
    add("--kv-budget", type=float, metavar="F", help="per-sequence KV budget, fraction of the full cache")
    add("--kv-budget-tokens", type=int, metavar="N", help="per-sequence KV budget in tokens")
    add("--kv-budget-basis", choices=["final", "length"],
        help="what --kv-budget is a fraction of: the full cache at the request's final length, prompt + "
             "max_tokens, held from its first token (final, default: what admission reserves) or at its "
             "current length (length)")
    add("--kv-tiers", type=_tier_list, metavar="T,T",
        help="conf-kv's kept tiers, highest first: full,int4,k4v2,int2 (default; precision tiers; k4v2: "
             "int4 keys, int2 values) or full,key_only (the default with an int8 or fp8 --kv-cache-dtype)")
    add("--no-prefix-cache", action="store_true", help="do not share KV blocks of common prefixes")
    add("--cache-dir", metavar="DIR",
        help="directory (NVMe) for evicted prefix blocks and their index, rebuilt at start-up")
    add("--drain-timeout", type=_seconds, metavar="S",
        help="on SIGTERM, seconds to let requests in progress finish while /ready answers 503 and new "
             "ones get 503 (default 30); keep it below the pod's grace period")
    add("--header-timeout", type=_seconds, metavar="S",
        help="seconds a client has to send a request's line and headers before the connection is closed "
             "with 408 (default 10)")
    add("--tensor-parallel", "--tp", type=int, metavar="N",
        help="shard the model over N ranks on this machine (one per GPU; gloo processes on CPU); "
             "N must divide the model's query and KV heads (default 1)")
    add("--nnodes", type=int, metavar="M",
        help="machines the --tensor-parallel group spans (torchrun's --nnodes; default 1); each runs "
             "N/M ranks")
    add("--node-rank", type=int, metavar="R",
        help="this machine's index in the group (default 0): 0 serves HTTP, the others only follow it")
    add("--master-addr", metavar="HOST",
        help="address of node 0, where the group meets (default 127.0.0.1; under a LeaderWorkerSet "
             "$(LWS_LEADER_ADDRESS))")
    add("--master-port", type=int, metavar="PORT",
        help=f"TCP port of the group's rendezvous on node 0 (needed with --nnodes > 1; torchrun's default "
             f"is {DEFAULT_MASTER_PORT})")
    add("--join-timeout", type=_seconds, metavar="S",
        help=f"seconds the nodes of a --nnodes group may take to meet before it gives up (default "
             f"{DEFAULT_JOIN_TIMEOUT_SECONDS:.0f})")
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
    names = getattr(args, "served_name", None)
    if isinstance(names, list):  # vLLM's --served-model-name list: the first is the primary name
        args.served_name, args.served_aliases = names[0], names[1:]
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
    if getattr(args, "no_prefix_cache", False):
        config = with_overrides(config, "confkv", prefix_cache={"enabled": False})
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


def build_topology(args: argparse.Namespace, config: ConfKVConfig) -> Topology:
    """The group's node layout from the flags; raises TopologyError naming the problem."""
    master_addr = getattr(args, "master_addr", None) or "127.0.0.1"
    return Topology(config.engine.tensor_parallel, getattr(args, "nnodes", None) or 1,
                    getattr(args, "node_rank", None) or 0, master_addr, getattr(args, "master_port", None),
                    getattr(args, "join_timeout", None) or DEFAULT_JOIN_TIMEOUT_SECONDS)


def serve(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        topology = build_topology(args, config)
    except (ConfigError, TopologyError) as err:
        print(f"confkv: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from confkv_engine.core.async_engine import configure_torch_threads

    try:
        configure_torch_threads(args.threads)
    except ValueError as err:
        print(f"confkv: invalid --threads / CONFKV_THREADS: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    device_error = _device_error(config.engine.device)
    if device_error is not None:
        print(f"confkv: {device_error}", file=sys.stderr)
        _write_termination_message(device_error)
        return EXIT_NO_DEVICE
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not topology.leads:  # a follower node: no HTTP, no control plane, no agent
        from confkv_engine.parallel.launch import serve_node

        return _exit(serve_node(config, topology))
    from confkv_engine.server import run_server

    agent = _start_agent(args, config) if getattr(args, "with_agent", False) else None
    try:
        status = run_server(config, log_level=args.log_level,
                            on_loaded=_announce(config.engine.host, config.engine.port),
                            topology=topology if topology.nodes > 1 else None, **_timeouts(args))
    finally:  # uvicorn exits through SystemExit when it cannot bind the port
        if agent is not None:
            agent.stop()
    return _exit(status)


def _exit(status: int) -> int:
    # Requests are drained and the engine thread is stopped; interpreter teardown (freeing the
    # model, torch's state) adds seconds to every pod termination and has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _device_error(device: str) -> str | None:
    """Checked before anything starts, so ``--device cuda`` on a machine without CUDA fails in
    seconds rather than after the control plane and the HTTP port came up."""
    if device == "cpu":
        return None
    from confkv_engine.model.loader import DeviceUnavailable, resolve_device

    try:
        resolve_device(device)
    except DeviceUnavailable as err:
        return str(err)
    return None


def _write_termination_message(message: str) -> None:
    """In a pod, the reason the engine exited becomes the container's termination message, which
    the operator and ``kubectl describe`` show; elsewhere the file does not exist and nothing is written."""
    if not os.path.isfile(TERMINATION_LOG):  # never create it outside a pod
        return
    try:
        with open(TERMINATION_LOG, "w") as out:
            out.write(message)
    except OSError:
        pass


def _timeouts(args: argparse.Namespace) -> dict[str, float]:
    """The server timeouts given on the command line (the others keep ``run_server``'s defaults)."""
    given = {"drain_timeout": getattr(args, "drain_timeout", None),
             "header_timeout": getattr(args, "header_timeout", None)}
    return {name: value for name, value in given.items() if value is not None}


def _start_agent(args: argparse.Namespace, config: ConfKVConfig) -> AgentProcess:
    """``--with-agent``: the agent gets the user's config file (live edits reach the engine), or, when
    flags changed the policy (the file would undo them) or there is no file, the effective config as
    a document on its stdin: nothing is written to disk, so nothing is left behind by a killed engine."""
    from confkv_agent.launcher import AgentProcess  # noqa: F811 - the runtime import of the hint

    socket = config.engine.control_socket
    policy_flags = any(getattr(args, dest, None) is not None
                       for dest, (section, _) in _OVERRIDES.items() if section == "confkv")
    if args.config is not None and not policy_flags:
        return AgentProcess(socket, config_path=args.config)
    return AgentProcess(socket, config_json=json.dumps(dump_config(config)))


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
