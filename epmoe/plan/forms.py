"""Parallel forms of one MoE layer, as data: the planner (or the CLI) picks one per layer
(`LayerSpec`, a stack entry of RunConfig) and each rank runs it as a `LayerPlan`.

| form  | tokens                   | experts                               | end of layer |
|-------|--------------------------|---------------------------------------|--------------|
| tp    | replicated on all ranks  | every expert, intermediate split      | all-reduce   |
| ep    | replicated on all ranks  | split across ranks (expert map)       | all-reduce   |
| ep_dp | each rank its own tokens | split across ranks; dispatch/combine  | none         |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from epmoe.config import MoEConfig, QuantConfig

Form = Literal["tp", "ep", "ep_dp"]
FORMS = ("tp", "ep", "ep_dp")


@dataclass(frozen=True)
class LayerSpec:
    """What one layer of a stack asks for (a plan file entry, or the planner's choice): the
    parallel form, the comm backend and the experts backend ("auto" = resolved per rank)."""

    form: Form
    backend: str = "auto"
    experts: str = "auto"

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form ({self.form!r}) must be one of {FORMS}")


@dataclass(frozen=True)
class LayerPlan:
    """How one layer runs on one rank.

    form           tp | ep | ep_dp
    rank, world    this rank and the group size (tp size for tp, ep size otherwise)
    backend        comm backend name (local for tp/ep; allgather, all2all, deepep-* for ep_dp)
    experts        experts backend name (torch, triton, deepgemm, auto)
    num_slots      physical expert slots (num_experts + redundant, for EPLB)
    """

    form: Form
    rank: int = 0
    world: int = 1
    backend: str = "local"
    experts: str = "torch"
    num_slots: int | None = None

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form ({self.form!r}) must be one of {FORMS}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank ({self.rank}) must lie in [0, world={self.world})")
        if self.form in ("tp", "ep") and self.backend != "local" and self.world > 1:
            raise ValueError(f"form {self.form!r} replicates tokens: its backend must be 'local' "
                             f"(got {self.backend!r}); use form ep_dp for {self.backend}")
        if self.form == "ep_dp" and self.backend == "local" and self.world > 1:
            raise ValueError("form ep_dp gives each rank its own tokens, which must travel to "
                             "their experts' ranks: backend local moves none; use another "
                             "backend (auto), or form ep (--no-dp)")

    @property
    def needs_all_reduce(self) -> bool:
        return self.form in ("tp", "ep") and self.world > 1

    def slots(self, cfg: MoEConfig) -> int:
        return cfg.num_experts if self.num_slots is None else self.num_slots

    def validate(self, cfg: MoEConfig, quant: QuantConfig) -> None:
        """Raise before any worker starts if the shapes cannot be split this way."""
        if self.form == "tp":
            if cfg.moe_intermediate % self.world:
                raise ValueError(f"moe intermediate ({cfg.moe_intermediate}) must be divisible "
                                 f"by tp ({self.world}); choose a tp that divides it")
            quant.check_shapes(cfg, cfg.moe_intermediate // self.world)
        else:
            if self.slots(cfg) % self.world:
                raise ValueError(f"experts ({self.slots(cfg)}) must be divisible by ep "
                                 f"({self.world}); choose an ep that divides it (or add "
                                 f"redundant experts)")
            quant.check_shapes(cfg)

    def local_slots(self, cfg: MoEConfig) -> list[int]:
        """Physical expert slots held by this rank (all of them under tp)."""
        n = self.slots(cfg)
        if self.form == "tp":
            return list(range(n))
        per = n // self.world
        return list(range(self.rank * per, (self.rank + 1) * per))

    def expert_map(self, cfg: MoEConfig) -> torch.Tensor:
        """int32 [num_slots]: physical slot -> local index, -1 when not here."""
        m = torch.full((self.slots(cfg),), -1, dtype=torch.int32)
        local = self.local_slots(cfg)
        m[local] = torch.arange(len(local), dtype=torch.int32)
        return m

    def inter_slice(self, cfg: MoEConfig):
        if self.form != "tp" or self.world == 1:
            return None
        n = cfg.moe_intermediate // self.world
        return (self.rank * n, n)

    def shared_slice(self, cfg: MoEConfig, quant: QuantConfig):
        """Shared MLP share: whole under ep_dp (own tokens); split like tp under tp/ep when it
        tiles (else rank 0 alone runs it). Returns (with_shared, slice)."""
        if not cfg.num_shared_experts:
            return False, None
        if self.form == "ep_dp" or self.world == 1:
            return True, None
        width = cfg.shared_intermediate
        g = max(quant.act_group, quant.weight_group[1], 1)
        if width % (self.world * g) == 0:
            n = width // self.world
            return True, (self.rank * n, n)
        return self.rank == 0, None
