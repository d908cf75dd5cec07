"""Planning: topology, hardware profiles, the cost model and the per-layer planner."""
