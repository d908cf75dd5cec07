"""Planning: topology, hardware profiles, the cost model and the per-layer planner.

    from epmoe.plan import Topology, load_profile, plan_stack, predict_layer
    plan = plan_stack(cfg, quant, Topology.parse("2x8"), load_profile("h200"), (128, 4096))
    RunConfig(..., stack=plan.stack(t), tokens=plan.run_tokens(t))   # what the runtime runs
    plan.stages_ms(t)                                                # predicted per stage

See README "Planning" and epmoe/plan/cost.py for the model.
"""

from epmoe.plan.cost import (STAGES, TOP_STAGES, Candidate, LayerPrediction, Workload,
                             predict_layer)
from epmoe.plan.planfile import Choice, LayerEntry, Plan
from epmoe.plan.planner import feasible, plan_stack, rank_layer
from epmoe.plan.profile import HardwareProfile, load_profile
from epmoe.plan.routing import RoutingSpec, SlotMap, routing_stats
from epmoe.plan.topology import Link, Topology

__all__ = ["STAGES", "TOP_STAGES", "Candidate", "LayerPrediction", "Workload", "predict_layer",
           "Choice", "LayerEntry", "Plan", "feasible", "plan_stack", "rank_layer",
           "HardwareProfile", "load_profile", "RoutingSpec", "SlotMap", "routing_stats", "Link",
           "Topology"]
