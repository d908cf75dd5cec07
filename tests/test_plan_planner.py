"""The planner's choices on synthetic profiles where the right answer is known by
construction; feasibility from the runtime's rules; plan files and LayerPlans."""

import pytest

from epmoe.config import MoEConfig, QuantConfig, get_preset
from epmoe.plan.cost import TOP_STAGES, Candidate
from epmoe.plan.forms import LayerPlan
from epmoe.plan.planfile import Plan
from epmoe.plan.planner import feasible, plan_stack
from epmoe.plan.profile import load_profile
from epmoe.plan.routing import RoutingSpec
from epmoe.plan.run import RunConfig
from epmoe.plan.synthetic import synthetic_profile
from epmoe.plan.topology import Link, Topology

CFG = MoEConfig("t", hidden=256, moe_intermediate=128, num_experts=16, top_k=4,
                num_moe_layers=2)
BF16 = QuantConfig("bf16")
TOPO = Topology(1, 4, "h200", links={"nvlink": Link("nvlink", 100.0, 0.0)})
ANY = frozenset({"local", "allgather", "all2all", "deepep-ht", "deepep-ll", "symm-ht",
                 "symm-ll"})


def plan(prof, buckets=(256,), **kw):
    kw.setdefault("available", ANY)
    return plan_stack(CFG, BF16, TOPO, prof, buckets, **kw)


def test_free_all_reduce_and_slow_links_pick_a_replicated_form():
    prof = synthetic_profile(all_reduce_GBps=1e9, link_eff=1e-4, collective_GBps=1e-3,
                             nccl_extra_us=1e6)
    c = plan(prof).layers[0].choice(256)
    assert c.form in ("tp", "ep") and c.backend == "local"


def test_slow_all_reduce_and_fast_links_pick_ep_dp():
    prof = synthetic_profile(all_reduce_GBps=1e-3, link_eff=1.0)
    c = plan(prof).layers[0].choice(256)
    assert c.form == "ep_dp" and c.runner_up is not None
    assert c.runner_up in c.why and f"{c.runner_up_us / 1e3:.3f} ms" in c.why


def test_skew_moves_the_pick_from_ep_dp_to_tp():
    """tp runs every expert on every rank (balanced whatever the routing); ep_dp waits for
    the hottest rank. all-reduce priced between the two outcomes."""
    prof = synthetic_profile(tflops={"triton": 1.0}, all_reduce_GBps=10.0)
    assert plan(prof, routing="uniform").layers[0].choice(256).form == "ep_dp"
    assert plan(prof, routing="zipf:2").layers[0].choice(256).form == "tp"


def test_the_fastest_experts_kernel_wins():
    prof = synthetic_profile(tflops={"torch": 1.0, "triton": 1000.0, "deepgemm": 10.0})
    assert plan(prof).layers[0].choice(256).experts == "triton"


def test_mixed_stack_charges_the_layout_transition():
    prof = synthetic_profile(tflops={"triton": 1.0}, all_reduce_GBps=10.0,
                             collective_GBps=100.0)
    uniform = [1.0] * 16
    skewed = list(RoutingSpec("zipf", 2.0).popularity(16))
    p = plan(prof, loads_LE=[uniform, skewed, uniform], num_layers=3)
    forms = [e.choice(256).form for e in p.layers]
    assert forms == ["ep_dp", "tp", "ep_dp"]
    trans = [e.choice(256).transition_us for e in p.layers]
    assert trans[0] == 0 and trans[1] > 0 and trans[2] == 0  # all-gather into tp only
    assert [e.choice(256).stages_us["relayout"] for e in p.layers] == trans
    # the runtime runs it as a mixed stack: one LayerSpec per layer, tokens per rank
    run = RunConfig(model="deepseek-v3-tiny", world=4, tokens=p.run_tokens(256),
                    stack=p.stack(256), layers=3)
    run.validate()
    assert run.forms == ("ep_dp", "tp", "ep_dp") and run.layer_tokens(1) == 4 * 256
    one = p.layers[1].choice(256)
    assert one.predicted_us == pytest.approx(one.transition_us + sum(
        one.stages_us[s] for s in TOP_STAGES if s != "relayout"))
    # an expensive transition keeps the stack in one form
    slow = synthetic_profile(tflops={"triton": 1.0}, all_reduce_GBps=10.0, collective_GBps=1.0)
    p = plan(slow, loads_LE=[uniform, skewed, uniform], num_layers=3)
    assert all(e.choice(256).transition_us == 0 for e in p.layers)


def test_memory_budget_excludes_and_explains():
    prof = synthetic_profile()
    with pytest.raises(ValueError, match="no candidate is feasible.*GiB"):
        plan(prof, memory_GiB=1e-6)
    p = plan(prof, buckets=(64,), memory_GiB=0.02, forms=("ep_dp",))
    assert p.layers[0].choice(64).backend != "deepep-ll"  # its buffers do not fit
    # one rank: the tp / ep candidates all give one reason; the error names each distinct
    # reason once, so the memory budget is not crowded out by them
    one = Topology(1, 1, "h200", links={"nvlink": Link("nvlink", 100.0, 0.0)})
    with pytest.raises(ValueError, match=r"one rank: every form is ep_dp/local; "
                                         r"ep_dp/local/\w+: needs .* GiB") as exc:
        plan_stack(CFG, BF16, one, prof, (256,), available=ANY, memory_GiB=1e-6)
    assert str(exc.value).count("one rank: every form") == 1


def test_a_profile_without_a_links_fits_is_named_as_the_fix():
    """Two nodes priced with a profile that knows no inter-node link (the CPU one): the error
    names the missing fits and asks for a profile that has them."""
    two = Topology.parse("2x2", "cpu")
    with pytest.raises(ValueError, match=r"profile 'cpu' has no \w+ fit on rdma.*give a "
                                         r"--profile with fits on those links"):
        plan_stack(CFG, BF16, two, load_profile("cpu"), (64,),
                   available=frozenset({"local", "allgather", "all2all"}))


def test_feasibility_reuses_the_runtime_rules():
    h200 = load_profile("h200")
    dsv3 = get_preset("deepseek-v3")
    fp8 = QuantConfig("fp8_block")
    two = Topology.parse("2x8")
    ht = Candidate("ep_dp", "deepep-ht", "deepgemm")
    assert "intranode" in feasible(ht, dsv3, fp8, two, h200, scope="runtime", available=ANY)
    assert feasible(ht, dsv3, fp8, two, h200, scope="model") is None
    assert feasible(ht, dsv3, fp8, Topology.parse("1x8"), h200, available=ANY) is None
    ll = Candidate("ep_dp", "deepep-ll", "deepgemm")
    wide = dsv3.replace(hidden=7296)
    # the backends' own pure rules, not a mirror of them
    from epmoe.comm.deepep import ll_shape_unsupported, shape_unsupported
    from epmoe.experts.deepgemm_experts import arch_unsupported

    assert feasible(ll, wide, fp8, Topology.parse("1x8"), h200, scope="model") == \
        ll_shape_unsupported(wide) and "low-latency kernels take hidden" in \
        ll_shape_unsupported(wide)
    assert feasible(ht, dsv3, fp8, Topology.parse("1x16"), h200, available=ANY) == \
        shape_unsupported(dsv3, fp8, 16)
    # model scope: where DeepEP V1's normal kernels run (8 GPUs per node across nodes)
    from epmoe.comm.deepep import normal_layout_unsupported

    for shape, ok in (("1x16", False), ("4x4", False), ("2x64", False), ("1x32", False),
                      ("1x4", True), ("4x8", True)):
        why = feasible(ht, dsv3, fp8, Topology.parse(shape), h200, scope="model")
        assert (why is None) == ok, (shape, why)
        t = Topology.parse(shape)
        assert why == normal_layout_unsupported(t.world, t.num_nodes, t.gpus_per_node)
    b200 = load_profile("b200")
    dg = Candidate("ep_dp", "all2all", "deepgemm")
    assert feasible(dg, dsv3, fp8, Topology.parse("1x8", gpu="b200"), b200, available=ANY) \
        == arch_unsupported(dsv3, fp8, 100) and "UE8M0" in arch_unsupported(dsv3, fp8, 100)
    tp = Candidate("tp", "local", "deepgemm")
    assert "divisible by tp" in feasible(tp, dsv3, fp8, Topology.parse("1x3"), h200)
    cpu = load_profile("cpu")
    assert "CUDA" in feasible(Candidate("ep_dp", "all2all", "triton"), CFG, BF16,
                              Topology.parse("1x2", gpu="cpu"), cpu)
    assert feasible(Candidate("ep_dp", "all2all", "torch"), CFG, BF16,
                    Topology.parse("1x2", gpu="cpu"), cpu) is None
    assert "not registered" in feasible(Candidate("ep_dp", "symm-ll", "deepgemm"), dsv3, fp8,
                                        Topology.parse("1x8"), h200, available={"all2all"})


def test_plan_file_round_trip_and_layer_plans(tmp_path):
    p = plan(synthetic_profile(), buckets=(16, 256))
    path = tmp_path / "plan.json"
    p.save(path)
    q = Plan.load(path)
    assert q == p
    lps = q.layer_plans(rank=3, tokens=100)  # -> the 256 bucket
    assert len(lps) == CFG.num_moe_layers and all(isinstance(x, LayerPlan) for x in lps)
    c = q.layers[0].choice(256)
    assert (lps[0].form, lps[0].backend, lps[0].experts, lps[0].rank, lps[0].world) == \
        (c.form, c.backend, c.experts, 3, 4)
    assert q.layers[0].choice(1) == q.layers[0].choice(16)
    ms = q.stages_ms(256)
    assert ms["experts"] == pytest.approx(sum(e.choice(256).stages_us["experts"]
                                              for e in q.layers) / 1e3)
    assert sum(ms[k] for k in TOP_STAGES) == pytest.approx(q.step_us(256) / 1e3)
    assert q.layers[0].choice(10**6) == c  # beyond the largest bucket: the largest
    path.write_text('{"schema": 1, "layers": []}')
    with pytest.raises(ValueError, match="malformed"):
        Plan.load(path)


def test_cpu_plan_uses_what_cpu_runs():
    cpu = load_profile("cpu")
    p = plan_stack(get_preset("deepseek-v3-tiny"), BF16, Topology.parse("1x2", gpu="cpu"), cpu,
                   (64,))
    c = p.layers[0].choice(64)
    assert c.experts == "torch" and c.backend in ("local", "all2all", "allgather")


def test_the_explanation_names_the_stage_where_the_pick_gains():
    """Not the stage with the largest difference: here the pick's shared MLP is slower, but
    it hides behind its routed stages on the side stream, and its experts are faster."""
    from epmoe.plan.cost import LayerPrediction
    from epmoe.plan.memory import Memory
    from epmoe.plan.planner import explain

    mem = Memory(0.0, 0.0, 0.0)

    def pred(experts_name, experts_us, shared_us, tail_us=0.0):
        stages = dict(relayout=0.0, router=10.0, dispatch=50.0, experts=experts_us,
                      combine=50.0, shared=shared_us, all_reduce=0.0)
        return LayerPrediction(Candidate("ep_dp", "symm-ht", experts_name), stages, {}, mem, {},
                               overlap_shared=True, tail_us=tail_us)

    best, runner = pred("deepgemm", 300.0, 380.0), pred("triton", 330.0, 200.0)
    assert best.total_us < runner.total_us
    why = explain(best, runner)
    assert why.endswith(": experts 300 vs 330 us"), why
    # the shared MLP outlasting its routed stages shows as what it adds; the tail as a stage
    best, runner = pred("deepgemm", 300.0, 500.0), pred("triton", 300.0, 600.0, tail_us=9.0)
    assert explain(best, runner).endswith(": shared 100 vs 200 us")
    best, runner = pred("deepgemm", 300.0, 100.0), pred("triton", 300.0, 100.0, tail_us=50.0)
    assert explain(best, runner).endswith(": tail 0 vs 50 us")
    assert explain(best, pred("triton", 300.5, 100.0)).endswith("a tie (stages within 0.5%)")


def test_a_stacks_later_layers_are_planned_from_the_queued_figures():
    """As the launch report predicts them (plan/backlog.py): layer 0 starts on an idle GPU
    (the router's host-bound fit), layers 1.. behind it while the layers before outrun the
    host's issue time (its queued fit); with an issue time longer than a layer, none."""
    from epmoe.plan.profile import AlphaBeta, Provenance

    m = Provenance("measured", "test")
    cfg = CFG.replace(num_moe_layers=3)
    base = synthetic_profile()
    kern = {**base.kernels, "router": {cfg.router: AlphaBeta(500.0, 1e9, m),
                                       f"{cfg.router}.queued": AlphaBeta(50.0, 1e9, m)}}
    for issue_us, want in ((1.0, [500.0, 50.0, 50.0]), (1e7, [500.0] * 3)):
        prof = base.replace(kernels={**kern, "layer": {"issue": AlphaBeta(issue_us, 1e9, m)}})
        p = plan_stack(cfg, BF16, TOPO, prof, (256,), available=ANY)
        got = [e.choice(256).stages_us["router"] for e in p.layers]
        assert got == pytest.approx(want), issue_us


def test_low_latency_buffers_bound_the_bucket_they_can_take():
    """DeepEP LL's buffer (num_experts x max tokens messages, sent and received, odd/even)
    must stay under DeepEP's 32 GiB int4 count; symm-ll's masked region under its 1024
    tokens: at DeepSeek-V3's 4096-token bucket on 2 ranks both are rejected (the sweep on two
    H200 saw both fail to build there), at 128 they run."""
    from epmoe.comm.deepep import LL_RDMA_LIMIT, ll_rdma_bytes
    from epmoe.plan.cost import Workload
    from epmoe.plan.planner import tokens_rule

    dsv3, fp8 = get_preset("deepseek-v3"), QuantConfig("fp8_block")
    # DeepEP's layout by hand: msgs 16 + 7168 * 2 (dispatch) and 56 * 4 + 7168 * 2 (combine)
    per = 256 * 128 * (56 * 4 + 7168 * 2)
    assert ll_rdma_bytes(128, 7168, 256) == 2 * (per + per + 1024)
    assert ll_rdma_bytes(2048, 7168, 256) < LL_RDMA_LIMIT < ll_rdma_bytes(4096, 7168, 256)
    big, small = Workload(dsv3, fp8, 4096), Workload(dsv3, fp8, 128)
    why = tokens_rule(Candidate("ep_dp", "deepep-ll", "deepgemm"), big)
    assert "past DeepEP's 32 GiB limit" in why and "4096 tokens per rank" in why
    assert "at most 1024 tokens" in tokens_rule(Candidate("ep_dp", "symm-ll", "triton"), big)
    for b in ("deepep-ll", "symm-ll", "symm-ht", "deepep-ht"):
        assert tokens_rule(Candidate("ep_dp", b, "triton"), small) is None
    assert tokens_rule(Candidate("ep_dp", "deepep-ht", "triton"), big) is None
    two = Topology(1, 2, "h200", links={"nvlink": Link("nvlink", 450.0, 0.0)})
    p = plan_stack(dsv3, fp8, two, load_profile("h200"), (128, 4096), num_layers=1,
                   available=ANY, forms=("ep_dp",))
    assert p.layers[0].choice(4096).backend not in ("deepep-ll", "symm-ll")
