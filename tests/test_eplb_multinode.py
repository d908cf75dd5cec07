"""EPLB over two Ray nodes on one machine (the two-node cluster of tests/test_multinode.py):
the ranks learn their nodes from Ray, the default mode turns hierarchical (deepseek-v3-tiny
routes group-limited: top 2 of 4 groups), and the placement keeps every expert group on the
ranks of one node."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.launch_util import describe, new_tag, run_launch, wait_gone
from tests.test_multinode import _wait_for_nodes, two_nodes  # noqa: F401  (the cluster fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(480)
def test_hierarchical_placement_keeps_groups_on_nodes(two_nodes, tmp_path):
    assert _wait_for_nodes(two_nodes, 2, within=60) == 2
    out = tmp_path / "summary.json"
    tag = new_tag()
    rc, _, err, wall, _ = run_launch(
        ["--ep", "4", "--eplb", "--redundant-experts", "4", "--routing", "zipf:1.2",
         "--rebalance-every", "2", "--steps", "4", "--tokens", "16", "--address",
         two_nodes.address, "--timeout", "200", "--out", str(out)], tag, timeout=400,
        auth=two_nodes.auth,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    print(f"{wall=:.1f}s rc={rc} {err[-500:]}")
    assert rc == 0, err
    s = json.loads(out.read_text())
    e, w = s["eplb"], s["world"]
    print({k: e[k] for k in ("placement_mode", "mode_reason", "topology")}, e["events"])
    assert s["correctness"]["passed"] is True, s["correctness"]
    # the driver's view (Ray node of each actor) and the ranks' own all-gather agree
    assert w["nodes"] == 2 and e["topology"]["num_nodes"] == 2
    node_of_rank = [r["node"] for r in sorted(w["ranks"], key=lambda r: r["rank"])]
    same = [[a == b for b in node_of_rank] for a in node_of_rank]
    mine = e["topology"]["node_of_rank"]
    assert same == [[a == b for b in mine] for a in mine], (node_of_rank, mine)
    assert e["placement_mode"] == "hierarchical", e["mode_reason"]
    assert "group-limited routing (top 2 of 4 groups) on 2 nodes" in e["mode_reason"]
    assert e["rebalances"] >= 1 and e["slots_moved"] > 0, e["events"]
    # every group (4 experts of 16) on the ranks of one node, two groups per node
    phy = e["final_phy2log_LR"]
    per_rank = len(phy[0]) // 4
    for l, p in enumerate(phy):
        node_of_group = {}
        for slot, expert in enumerate(p):
            node = node_of_rank[slot // per_rank]
            assert node_of_group.setdefault(expert // 4, node) == node, f"layer {l}: {p}"
        assert sorted(node_of_group.values()) == [0, 0, 1, 1], f"layer {l}: {p}"
    left = wait_gone(tag, within=15)
    assert not left, f"left behind: {describe(left)}"
