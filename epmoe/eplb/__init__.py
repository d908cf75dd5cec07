"""Expert-parallel load balancing: replica placement, traffic, synthetic routing, rebalancing.

Files: placement.py (the Placement type and load arithmetic), policy.py (the two modes and the
default rule), deepseek.py (DeepSeek EPLB, the baseline), packing.py (our packing),
incremental.py (few-move re-placement), traffic.py (token fan-out and inter-node bytes),
routing.py (synthetic routing and traces), recorder.py (load window), migrate.py (weight
moves), topology.py (which node each rank is on), rebalancer.py (the runtime's rebalancer).
"""

from epmoe.eplb.incremental import rebalance_incremental
from epmoe.eplb.placement import Placement
from epmoe.eplb.policy import MODES, ModeChoice, choose_mode, deepseek_rebalance, rebalance
from epmoe.eplb.routing import load_trace, make_routing, save_trace

__all__ = ["MODES", "ModeChoice", "Placement", "choose_mode", "deepseek_rebalance",
           "load_trace", "make_routing", "rebalance", "rebalance_incremental", "save_trace"]
