"""Where this process sits in a tensor-parallel group that may span machines (torchrun's terms).

``engine.tensorParallel`` is the whole group's degree. One machine (``nodes`` 1) runs every rank;
across machines each node runs ``degree / nodes`` ranks, numbered node by node, so global rank =
``node_rank * ranks_per_node + local rank``. Rank 0 (node 0's first rank) serves HTTP and leads; it
also hosts the group's rendezvous (``torch.distributed``'s TCP store) at ``master_addr:master_port``.

Under a LeaderWorkerSet the operator passes LWS's own variables on the command line:
``--nnodes <size> --node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)``.

Pure data: no torch import, so the command line validates it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass

#: torchrun's default rendezvous port (used across nodes; one node picks a free local port).
DEFAULT_MASTER_PORT = 29500
#: How long a group across nodes waits for all of them (torchrun's rendezvous waits 600 s too).
DEFAULT_JOIN_TIMEOUT_SECONDS = 600.0


class TopologyError(ValueError):
    """A node layout that cannot form the group (bad flags)."""


@dataclass(frozen=True)
class Topology:
    degree: int = 1
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: one node, a free local port chosen at start
    # Seconds the nodes may take to meet (a peer pod may still pull its image or download weights).
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.degree % self.nodes:
            raise TopologyError(f"--nnodes {self.nodes} must be >= 1 and divide --tensor-parallel "
                                f"{self.degree}")
        if not 0 <= self.node_rank < self.nodes:
            raise TopologyError(f"--node-rank {self.node_rank} must be in [0, {self.nodes})")
        if self.nodes > 1 and self.master_port is None:
            raise TopologyError("a group across nodes needs --master-port (every node must use the same)")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise TopologyError(f"--master-port {self.master_port} is not a TCP port")
        if not self.join_timeout_s > 0:
            raise TopologyError(f"--join-timeout must be > 0 seconds, got {self.join_timeout_s}")

    @property
    def ranks_per_node(self) -> int:
        return self.degree // self.nodes

    @property
    def first_rank(self) -> int:
        """The global rank of this node's first process (it runs in the process started here)."""
        return self.node_rank * self.ranks_per_node

    @property
    def leads(self) -> bool:
        """This node runs rank 0: the HTTP server, the scheduler and the sampling."""
        return self.node_rank == 0

    def local_ranks(self) -> range:
        """Global ranks of the processes this node spawns (its first rank is the process itself)."""
        return range(self.first_rank + 1, self.first_rank + self.ranks_per_node)
