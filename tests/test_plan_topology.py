"""Topology: parsing, construction from per-rank node ids and JSON, and the errors."""

import json

import pytest

from epmoe.plan.topology import LINK_SPECS, Link, Topology


def test_parse_nodes_by_gpus():
    t = Topology.parse("2x8", gpu="h800")
    assert (t.num_nodes, t.gpus_per_node, t.world) == (2, 8, 16)
    assert t.node_of_rank == tuple(r // 8 for r in range(16))
    assert t.link("nvlink").GBps == LINK_SPECS["h800"]["nvlink"].GBps == 200.0
    assert t.link("rdma").GBps == 50.0
    assert Topology.parse(" 4 ").world == 4 and Topology.parse("4").num_nodes == 1


@pytest.mark.parametrize("bad", ["2y8", "x8", "2x", "", "0x8", "2x0", "-1x2"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError, match="NODESxGPUS|positive int"):
        Topology.parse(bad)


def test_from_node_ids_keeps_the_rank_map():
    t = Topology.from_node_ids(["b", "a", "b", "a"], gpu="h200")
    assert (t.num_nodes, t.gpus_per_node) == (2, 2)
    assert t.node_of_rank == (0, 1, 0, 1)  # node indices in order of first appearance
    with pytest.raises(ValueError, match="ranks per node differ"):
        Topology.from_node_ids(["a", "a", "b"])
    with pytest.raises(ValueError, match="empty"):
        Topology.from_node_ids([])


def test_json_round_trip_and_errors(tmp_path):
    t = Topology.parse("2x4", gpu="b200").with_link("rdma", GBps=100.0)
    p = tmp_path / "topo.json"
    p.write_text(json.dumps(t.to_dict()))
    u = Topology.from_json(p)
    assert u == t and u.link("rdma").GBps == 100.0
    assert Topology.resolve(str(p)) == t
    p.write_text(json.dumps({"num_nodes": 2, "gpus_per_node": 4, "colour": "red"}))
    with pytest.raises(ValueError, match="unknown keys"):
        Topology.from_json(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        Topology.from_json(p)
    with pytest.raises(ValueError, match="does not exist"):
        Topology.from_json(tmp_path / "missing.json")


def test_validation_messages():
    with pytest.raises(ValueError, match="no rdma link figures"):
        Topology(2, 4, "mystery-gpu", links={"nvlink": Link("nvlink", 100.0, 1.0)})
    with pytest.raises(ValueError, match="node 0 holds 3 ranks"):
        Topology(2, 2, "h200", node_of_rank=(0, 0, 0, 1))
    with pytest.raises(ValueError, match="bandwidth"):
        Link("nvlink", 0.0, 1.0)
    with pytest.raises(ValueError, match="intra-node link"):
        Topology(1, 2, "h200", intra="rdma")
    assert Topology.parse("1x2", gpu="cpu").intra == "tcp"


def test_cpu_ranks_sharing_cores():
    t = Topology.parse("1x8", gpu="cpu", cores_per_node=2)
    assert t.oversubscription == 4.0 and "2 cores/node" in t.describe()
    assert Topology.parse("1x2", gpu="cpu", cores_per_node=4).oversubscription == 1.0
    assert Topology.parse("1x8").oversubscription == 1.0  # a GPU per rank
    assert Topology.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match=r"cores_per_node \(-1\) must be an int >= 0"):
        Topology.parse("1x2", gpu="cpu", cores_per_node=-1)


@pytest.mark.parametrize("d,msg", [
    ({"num_nodes": 1.5, "gpus_per_node": 8}, r"num_nodes \(1.5\) must be a positive int"),
    ({"num_nodes": True, "gpus_per_node": 8}, r"num_nodes \(True\) must be a positive int"),
    ({"num_nodes": 1, "gpus_per_node": "x"}, r"gpus_per_node \('x'\) must be a positive int"),
    ({"num_nodes": 1, "gpus_per_node": 2, "links": {"nvlink": {"GBps": "fast"}}},
     r"link 'nvlink': GBps and latency_us must be numbers, got \['fast', 0.0\]"),
    ({"num_nodes": 1, "gpus_per_node": 2, "node_of_rank": [0, 0.0]},
     r"node_of_rank \(\[0, 0.0\]\) must be node indices"),
    ([1, 2], r"a topology is an object with .*, got list"),
])
def test_a_topology_file_is_taken_as_written_or_refused(d, msg):
    """A count is never rounded (1.5 nodes, true) and a bad field is named, not a bare
    int() / float() error."""
    with pytest.raises(ValueError, match=msg):
        Topology.from_dict(d)
