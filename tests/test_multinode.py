"""Two Ray nodes on one machine (a head and a second node, separate processes with their own
ports and 2 CPUs each): `python -m epmoe.launch --ep 4 --address ...` must spread its ranks
over both nodes and still match the oracle."""

from __future__ import annotations

import json
import time

import pytest

from tests.launch_util import RayNodes, describe, new_tag, ray_nodes, run_launch, wait_gone

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes():
    try:
        with ray_nodes(num_cpus=2, extra_nodes=1) as nodes:
            yield nodes
    except RuntimeError as e:
        pytest.skip(f"Ray cannot form two nodes on this machine: {e}")


def _wait_for_nodes(nodes: RayNodes, n: int, within: float) -> int:
    """Alive nodes as the GCS sees them (the second raylet registers asynchronously)."""
    import os
    import subprocess
    import sys

    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', "
            "log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + within
    alive = 0
    while time.monotonic() < deadline:
        r = subprocess.run([sys.executable, "-c", code, nodes.address], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, **nodes.auth))
        alive = int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else 0
        if alive >= n:
            return alive
        time.sleep(1)
    return alive


@pytest.mark.timeout(420)
def test_ep4_over_two_nodes(two_nodes, tmp_path):
    assert _wait_for_nodes(two_nodes, 2, within=60) == 2
    out = tmp_path / "summary.json"
    tag = new_tag()
    rc, _, err, wall, seen = run_launch(["--ep", "4", "--tokens", "8", "--steps", "2",
                                         "--address", two_nodes.address, "--timeout", "120",
                                         "--out", str(out)], tag, timeout=360,
                                        auth=two_nodes.auth)
    print(f"{wall=:.1f}s rc={rc} {err[-500:]}")
    assert rc == 0, err
    s = json.loads(out.read_text())
    w = s["world"]
    assert w["ep"] == 4 and len(w["ranks"]) == 4
    assert w["nodes"] == 2, w["ranks"]
    per_node = [sum(r["node"] == n for r in w["ranks"]) for n in (0, 1)]
    assert per_node == [2, 2], w["ranks"]  # 2 CPUs a node, one per rank
    assert s["correctness"]["passed"] is True, s["correctness"]
    assert sum(s["load"]["tokens_per_rank"]) == 8 * 4 * 4 * 2 * 2
    assert len(seen) >= 4
    left = wait_gone(tag, within=15)  # the run's actors are gone; the cluster stays
    assert not left, f"left behind: {describe(left)}"
