"""The pure parts of the multi-host rendezvous: which node hosts, the node check's messages."""

from __future__ import annotations

import pytest

from polytrain.errors import ClusterError
from polytrain.launch.multinode import (
    NodeInfo,
    check_nodes,
    interface_of,
    is_local_address,
    local_address,
    resolve,
)


def test_this_machine_owns_loopback_but_not_a_foreign_address() -> None:
    assert is_local_address("127.0.0.1")
    assert not is_local_address("192.0.2.7")  # TEST-NET-1, never assigned to a host


def test_local_address_and_its_interface() -> None:
    assert local_address("127.0.0.1", 29400) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.7") is None


def test_an_unresolvable_endpoint_is_one_line() -> None:
    with pytest.raises(ClusterError, match="does not resolve"):
        resolve("no-such-host.invalid")


def test_node_check_accepts_distinct_ranks_and_names_the_clashing_hosts() -> None:
    check_nodes([NodeInfo("10.0.0.2", 1, 2), NodeInfo("10.0.0.1", 0, 2)])
    with pytest.raises(
        ClusterError, match=r"nodes 10.0.0.1 and 10.0.0.2 both passed --node-rank 0"
    ):
        check_nodes([NodeInfo("10.0.0.1", 0, 2), NodeInfo("10.0.0.2", 0, 2)])
    with pytest.raises(ClusterError, match=r"10.0.0.1 says 2, 10.0.0.2 says 3"):
        check_nodes([NodeInfo("10.0.0.1", 0, 2), NodeInfo("10.0.0.2", 1, 3)])


def test_node_info_round_trip() -> None:
    node = NodeInfo.decode(NodeInfo("10.0.0.9", 3, 4).encode().encode())
    assert (node.addr, node.node_rank, node.nnodes) == ("10.0.0.9", 3, 4)
