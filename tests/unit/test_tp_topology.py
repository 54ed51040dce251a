"""The node layout of a tensor-parallel group (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``): ranks numbered node by node, and flags that cannot form a group refused with
exit status 2 before anything loads."""

from __future__ import annotations

import pytest

from confkv_engine.cli import main
from confkv_engine.parallel.topology import Topology, TopologyError


def test_ranks_are_numbered_node_by_node() -> None:
    second = Topology(degree=8, nodes=2, node_rank=1, master_addr="lead.ns", master_port=29500)
    assert second.ranks_per_node == 4 and second.first_rank == 4 and not second.leads
    assert list(second.local_ranks()) == [5, 6, 7]
    one = Topology(degree=3)
    assert one.leads and list(one.local_ranks()) == [1, 2] and one.master_port is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"degree": 2, "nodes": 3, "master_port": 1}, "--nnodes 3 must be >= 1 and divide --tensor-parallel 2"),
    ({"degree": 4, "nodes": 2, "node_rank": 2, "master_port": 1}, "--node-rank 2 must be in"),
    ({"degree": 4, "nodes": 2}, "needs --master-port"),
    ({"degree": 4, "nodes": 2, "master_port": 70000}, "is not a TCP port"),
])
def test_impossible_layouts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology(**kwargs)


def test_bad_node_flags_exit_2_with_the_reason(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--tensor-parallel", "3", "--nnodes", "2", "--master-port", "29500"]) == 2
    assert "--nnodes 2 must be >= 1 and divide --tensor-parallel 3" in capsys.readouterr().err
    assert main(["serve", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel", "2"]) == 2
    assert "needs --master-port" in capsys.readouterr().err
