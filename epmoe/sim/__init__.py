"""Scaling simulator: the planner's cost model over sweeps of models, GPUs and scales."""
