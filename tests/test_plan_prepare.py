"""`launch.planning.prepare`: a launch's flags -> its run and planning, before any worker; the
re-plan once the ranks say where they landed."""

from __future__ import annotations

import pytest

from epmoe.launch.cli import build_run, parser
from epmoe.launch.planning import PlannedLaunch, prepare

TINY = ["--model", "deepseek-v3-tiny"]


def _args(*flags):
    return parser().parse_args([*TINY, *flags])


def test_at_where_replans_for_the_cluster_topology():
    """Before the start the planner assumes one node; the ranks' node ids change that."""
    launch = prepare(_args("--plan", "auto", "--ep", "2", "--tokens", "8", "--layers", "2",
                           "--profile", "h200"), build_run)
    assert isinstance(launch, PlannedLaunch) and launch.planning.topology.num_nodes == 1
    same = launch.at_where([dict(node_id="a", device="cpu")] * 2)
    assert same is launch.run and launch.planning.topology.num_nodes == 1
    run = launch.at_where([dict(node_id="a", device="cpu"), dict(node_id="b", device="cpu")])
    topo = launch.planning.topology
    assert (topo.num_nodes, topo.gpus_per_node, topo.node_of_rank) == (2, 1, (0, 1))
    assert any("re-planned for 2x1" in n for n in launch.planning.notes)
    assert launch.planning.plan.topology["num_nodes"] == 2
    assert run.stack == launch.planning.plan.stack(8)
    # given: the topology is kept whatever the ranks say
    given = prepare(_args("--plan", "auto", "--ep", "2", "--tokens", "8", "--layers", "2",
                          "--topology", "2x1", "--profile", "h200"), build_run)
    assert given.planning.topology.num_nodes == 2
    given.at_where([dict(node_id="a", device="cpu")] * 2)
    assert given.planning.topology.num_nodes == 2


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_one_rank_plans_tp_and_ep_as_ep_dp(mode):
    """On one rank the three forms compute the same; --plan tp|ep runs (as ep_dp), with a
    note, instead of finding every candidate infeasible."""
    launch = prepare(_args("--plan", mode, "--tokens", "8", "--layers", "2", "--device",
                           "cpu"), build_run)
    assert [lp.form for lp in launch.run.stack] == ["ep_dp", "ep_dp"]
    assert launch.planning.mode == mode
    assert any(f"one rank: {mode} computes what ep_dp does" in n
               for n in launch.planning.notes)
    with pytest.raises(ValueError, match="--tp 2 asks every layer to run tp"):
        prepare(_args("--plan", "ep", "--tp", "2"), build_run)


def test_ranks_sharing_a_gpu_get_no_prediction():
    """Their times are time slices of one GPU: a predicted/measured ratio would mislead."""
    from epmoe.launch.plan_report import predict_run

    launch = prepare(_args("--ep", "2", "--ranks-per-gpu", "2", "--backend", "symm-ht",
                           "--device", "cuda", "--tokens", "8", "--profile", "h200"), build_run)
    pred = predict_run(launch.run, [{}], launch.planning)
    assert pred["predicted_ms"] is None and pred["predicted_step_ms"] is None
    assert pred["prediction"]["error"] == ("2 ranks share each GPU (time-sliced), which the "
                                           "cost model does not describe")


@pytest.mark.parametrize("flags", [["--ep", "4"], ["--ep", "2", "--plan", "ep_dp"]])
def test_ep_dp_with_backend_local_exits_2(flags, capsys):
    """Each rank's own tokens with no comm: their other experts would never see them (the
    run once passed the flags on and failed the oracle at 1.0)."""
    from epmoe.launch.cli import main

    assert main([*TINY, *flags, "--backend", "local", "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "form ep_dp gives each rank its own tokens" in err and "backend local" in err


def test_a_gpu_profile_never_plans_cuda_work_for_cpu_ranks():
    """--profile h100 on CPU ranks: the H100's figures rank the candidates, but only what
    the CPU runs is planned (a symm-ht pick once failed every rank's build, exit 3); Triton's
    interpreter only when asked for."""
    launch = prepare(_args("--plan", "auto", "--ep", "2", "--tokens", "8", "--layers", "2",
                           "--profile", "h100", "--device", "cpu"), build_run)
    r = launch.planning.restrict
    assert r["available"] == {"local", "allgather", "all2all"} and r["experts"] == ("torch",)
    assert {(s.backend, s.experts) for s in launch.run.stack} <= {
        ("local", "torch"), ("allgather", "torch"), ("all2all", "torch")}
    asked = prepare(_args("--plan", "auto", "--ep", "2", "--tokens", "8", "--layers", "2",
                          "--profile", "h100", "--device", "cpu", "--experts", "triton"),
                    build_run)
    assert asked.planning.restrict["experts"] == ("triton",)
