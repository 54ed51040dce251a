"""``confkv serve --tensor-parallel N [--nnodes M --node-rank R --master-addr A --master-port P]``.

On one machine the serving process is rank 0 (HTTP, gRPC control, scheduler, sampling); it spawns
ranks 1..N-1 as ``torch.multiprocessing`` children (spawn start method, torchrun's environment
variables) which load the same checkpoint, keep their shard and follow rank 0's steps
(``parallel.engine``). Across M machines (``parallel.topology``) every node runs N/M ranks the same
way: node 0's first process serves; another node's first process (``serve_node``) serves nothing
and follows rank 0 like its children; a node that loses a rank or rank 0 exits non-zero, so its pod
restarts (a LeaderWorkerSet then recreates the whole group).

Choices written down here because the brief of a user of vLLM expects them:
- the degree must divide the query heads and the KV heads (and the MLP width): refused before any
  rank starts, with the numbers in the message;
- weights load dense (``model.weights`` auto becomes the dtype's dense mode; int4 / int8 are refused:
  their packed layouts are not sharded);
- every rank's pool is ``confkv.maxCacheSize`` of its own device: a rank holds only its KV heads, so
  the same pool holds ``N`` times the tokens per device byte;
- a rank that exits ends the server at once (rank 0 watches its children), and one that hangs ends
  it when the group's collective timeout (``DEFAULT_TIMEOUT_SECONDS``) expires: exit code
  ``EXIT_RANK_LOST`` with the reason on stderr, so the pod restarts instead of hanging;
- background compression of cached blocks is switched off (it runs on a timer per process and
  would make the ranks' caches differ);
- the disk store (``engine.cacheDir``) keeps one shard per rank, in ``tp<N>-rank<r>`` under the
  directory, and read-backs are agreed by every rank (``parallel.disk``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import torch

from confkv_api.config import ConfKVConfig, with_overrides
from confkv_engine.core.parts import build_parts
from confkv_engine.parallel.disk import RankDiskSink
from confkv_engine.parallel.engine import LeaderEngine, WorkerEngine
from confkv_engine.parallel.group import (
    DEFAULT_TIMEOUT_SECONDS,
    KVHeadShards,
    TensorParallelError,
    TPGroup,
    check_degree,
    destroy_group,
    init_group,
)
from confkv_engine.parallel.shard import shard_model
from confkv_engine.parallel.topology import Topology
from confkv_engine.retention.policies import RetentionConfig

log = logging.getLogger(__name__)
EXIT_RANK_LOST = 3


def tp_config(config: ConfKVConfig) -> ConfKVConfig:
    """The config every rank runs (see the module docstring); raises TensorParallelError."""
    if config.model.weights in ("int4", "int8"):
        raise TensorParallelError(f"weights {config.model.weights!r} cannot be sharded: use auto, fp32 or "
                                  f"bf16 with tensorParallel > 1")
    dense = "bf16" if config.model.dtype == "bfloat16" else "fp32"
    config = with_overrides(config, "model", weights=dense)
    return with_overrides(config, "confkv", compression={**config.confkv.compression.model_dump(),
                                                         "enabled": False})


def _load(config: ConfKVConfig) -> Any:
    from confkv_engine.model.loader import load_model, resolve_device, resolve_dtype

    device = resolve_device(config.engine.device)
    return load_model(config.model.source, resolve_dtype(config.model.dtype, device), device,
                      weights=config.model.weights)


def build_rank(loaded: Any, config: ConfKVConfig, group: TPGroup, leader: bool,
               retention: RetentionConfig | None = None) -> LeaderEngine | WorkerEngine:
    """Shard ``loaded``'s model for ``group.rank`` and build that rank's engine on it
    (``retention`` overrides the config's retention defaults, as ``build_parts``'s does)."""
    shard_model(loaded.model, group)
    parts = build_parts(loaded, config, retention, shards=KVHeadShards(group),
                        make_disk=lambda cache_dir: RankDiskSink(cache_dir, group))
    cls = LeaderEngine if leader else WorkerEngine
    return cls(group, loaded, config, parts=parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, topology: Topology, port: int, device: str, timeout_s: float) -> TPGroup:
    local = rank - topology.first_rank
    join = topology.join_timeout_s if topology.nodes > 1 else None  # one node: its ranks start together
    return init_group(rank, topology.degree, port, device, timeout_s, master_addr=topology.master_addr,
                      local_rank=local, join_timeout_s=join)


def worker_main(rank: int, topology: Topology, port: int, config_json: str, timeout_s: float) -> None:
    """A spawned rank: load, shard, follow rank 0 until it stops; exit non-zero on a lost group."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    config = ConfKVConfig.model_validate_json(config_json)
    try:
        loaded = _load(config)
        group = _join(rank, topology, port, str(loaded.device), timeout_s)
        engine = build_rank(loaded, config, group, leader=False)
        engine.serve_forever()  # type: ignore[union-attr]
        destroy_group()
    except Exception as err:  # the group is lost: say so and leave (rank 0 exits on its side)
        print(f"confkv: tensor-parallel rank {rank} stopped: {type(err).__name__}: {err}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_RANK_LOST)


def rank_lost(reason: str) -> None:
    """End the serving process: a group with a missing rank can never step again."""
    print(f"confkv: tensor-parallel group lost: {reason}; stopping the server", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


class Node:
    """This machine's share of the group: its first rank runs here, the others are spawned children
    (``torch.multiprocessing`` spawn), watched so that one that exits ends this process too."""

    def __init__(self, config: ConfKVConfig, topology: Topology | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.config, self.timeout_s = tp_config(config), timeout_s
        self.topology = topology or Topology(config.engine.tensor_parallel)
        if self.topology.degree != config.engine.tensor_parallel:
            raise TensorParallelError(f"the node layout is for {self.topology.degree} ranks, "
                                      f"engine.tensorParallel is {config.engine.tensor_parallel}")
        self.procs: list[Any] = []

    def join(self) -> tuple[Any, TPGroup]:
        """Load (the degree is checked before any rank starts), spawn this node's other ranks, join."""
        loaded = _load(self.config)
        check_degree(self.topology.degree, loaded.model.args.num_heads, loaded.model.args.num_kv_heads)
        port = self.topology.master_port or _free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        body = self.config.model_dump_json(by_alias=True)
        for rank in self.topology.local_ranks():
            proc = ctx.Process(target=worker_main, args=(rank, self.topology, port, body, self.timeout_s),
                               daemon=True, name=f"confkv-tp-rank{rank}")
            proc.start()
            self.procs.append(proc)
        group = _join(self.topology.first_rank, self.topology, port, str(loaded.device), self.timeout_s)
        return loaded, group

    def check_children(self) -> None:
        """End the process (``rank_lost``) when a spawned rank has exited."""
        for rank, proc in zip(self.topology.local_ranks(), self.procs, strict=True):
            if proc.exitcode is not None:
                rank_lost(f"rank {rank} exited with code {proc.exitcode}")


class Leader(Node):
    """Rank 0's side of the group: the spawned ranks, the heartbeat and the watch on both."""

    def __init__(self, config: ConfKVConfig, topology: Topology | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        super().__init__(config, topology, timeout_s)
        self.engine: LeaderEngine | None = None

    def start(self) -> tuple[Any, LeaderEngine]:
        loaded, group = self.join()
        self.engine = build_rank(loaded, self.config, group, leader=True)  # type: ignore[assignment]
        self.engine.on_group_lost = rank_lost  # type: ignore[union-attr]
        threading.Thread(target=self._watch, name="confkv-tp-watch", daemon=True).start()
        return loaded, self.engine  # type: ignore[return-value]

    def _watch(self) -> None:
        """Exit when a local rank exits; keep idle workers' collectives within the timeout (a rank
        on another node that stops answering makes the heartbeat's collective raise)."""
        every = max(0.5, self.timeout_s / 4)
        while self.engine is not None and not self.engine.stopped:
            self.check_children()
            try:
                self.engine.heartbeat(every)
            except Exception as err:  # a collective timed out or a peer closed its connection
                rank_lost(f"{type(err).__name__}: {err}")
            time.sleep(0.2)


def serve_node(config: ConfKVConfig, topology: Topology) -> int:
    """A node other than rank 0's (``--node-rank`` > 0): no HTTP, no control plane; its ranks follow
    rank 0 until it stops them (exit 0) or the group is lost (exit ``EXIT_RANK_LOST``)."""
    node = Node(config, topology)
    try:
        loaded, group = node.join()
        engine = build_rank(loaded, node.config, group, leader=False)
    except Exception as err:
        print(f"confkv: node {topology.node_rank} could not join the group: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        return EXIT_RANK_LOST

    def watch() -> None:
        while True:
            node.check_children()
            time.sleep(0.2)

    threading.Thread(target=watch, name="confkv-tp-watch", daemon=True).start()
    log.info("node %d: ranks %d..%d joined the group of %d; following rank 0", topology.node_rank,
             topology.first_rank, topology.first_rank + topology.ranks_per_node - 1, topology.degree)
    try:
        engine.serve_forever()  # type: ignore[union-attr]
    except Exception as err:
        rank_lost(f"rank {topology.first_rank}: {type(err).__name__}: {err}")
    destroy_group()
    return 0


def start_leader(config: ConfKVConfig, registry: Any = None,
                 topology: Topology | None = None) -> tuple[Any, LeaderEngine]:
    """Rank 0 of a group of ``engine.tensorParallel`` ranks (``topology``: on several nodes; default
    all on this one): (loaded model, its engine). With a Prometheus ``registry``, /metrics gains
    every rank's KV usage (``RankKVCollector``)."""
    loaded, engine = Leader(config, topology).start()
    if registry is not None:
        from confkv_engine.parallel.metrics import RankKVCollector

        registry.register(RankKVCollector(engine))
    return loaded, engine
