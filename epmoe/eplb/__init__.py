"""Expert-parallel load balancing: replica placement and synthetic routing."""

from epmoe.eplb.placement import (POLICIES, Placement, deepseek_rebalance, rebalance,
                                  rebalance_incremental)
from epmoe.eplb.routing import load_trace, make_routing, save_trace

__all__ = ["POLICIES", "Placement", "deepseek_rebalance", "load_trace", "make_routing",
           "rebalance", "rebalance_incremental", "save_trace"]
