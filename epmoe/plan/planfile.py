"""A plan is data: per MoE layer and per token-count bucket, the chosen (form, comm backend,
experts kernel), its predicted stages and a one-line reason. It serializes to a JSON plan file
(one entry per layer) and maps to the runtime's per-layer `LayerPlan`s.

Bucket rule: a step of T tokens per rank uses the smallest bucket >= T (the largest bucket
when T exceeds every bucket). Token counts are per rank, as `--tokens` under ep_dp; the
replicated forms process the global batch (tokens x ranks) on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epmoe.config import QuantConfig
from epmoe.docfile import read_doc
from epmoe.outputs import json_text
from epmoe.plan.forms import LayerPlan, LayerSpec

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class Choice:
    """The pick for one layer at one bucket.

    predicted_us   the layer's predicted time (sum of top-level stages), plus transition_us
    stages_us      predicted time per runtime stage (StageTimer names)
    transition_us  the runtime's "relayout" entering this layer (all-gather when the previous
                   layer was ep_dp and this one replicates tokens; 0 otherwise), also in
                   stages_us["relayout"]
    runner_up      label of the next-best candidate and its predicted_us (None if alone)
    why            one line: the pick, the runner-up and the stage that separates them
    """

    form: str
    backend: str
    experts: str
    predicted_us: float
    stages_us: dict
    why: str
    runner_up: str | None = None
    runner_up_us: float | None = None
    transition_us: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.form}/{self.backend}/{self.experts}"

    @property
    def spec(self) -> LayerSpec:
        """The runtime's per-layer request (RunConfig.stack entry)."""
        return LayerSpec(self.form, self.backend, self.experts)

    def layer_plan(self, rank: int, world: int, num_slots: int | None = None) -> LayerPlan:
        return LayerPlan(self.form, rank, world, self.backend if world > 1 else "local",
                         self.experts, num_slots)

    def to_dict(self) -> dict:
        return {"form": self.form, "backend": self.backend, "experts": self.experts,
                "predicted_us": self.predicted_us, "transition_us": self.transition_us,
                "stages_us": dict(self.stages_us), "runner_up": self.runner_up,
                "runner_up_us": self.runner_up_us, "why": self.why}

    @classmethod
    def from_dict(cls, d: dict) -> "Choice":
        return cls(d["form"], d["backend"], d["experts"], float(d["predicted_us"]),
                   {k: float(v) for k, v in d.get("stages_us", {}).items()}, d.get("why", ""),
                   d.get("runner_up"), None if d.get("runner_up_us") is None
                   else float(d["runner_up_us"]), float(d.get("transition_us", 0.0)))


@dataclass(frozen=True)
class LayerEntry:
    """One MoE layer: (bucket tokens, Choice) pairs, buckets ascending."""

    layer: int
    choices: tuple[tuple[int, Choice], ...]

    def choice(self, tokens: int) -> Choice:
        for bucket, c in self.choices:
            if tokens <= bucket:
                return c
        return self.choices[-1][1]


@dataclass(frozen=True)
class Plan:
    """model, quant, topology (Topology.to_dict()), profile name, world, num_slots (experts +
    redundant), buckets (tokens per rank), one LayerEntry per MoE layer."""

    model: str
    quant: QuantConfig
    topology: dict
    profile: str
    num_slots: int
    buckets: tuple[int, ...]
    layers: tuple[LayerEntry, ...]
    scope: str = "runtime"

    @property
    def world(self) -> int:
        return int(self.topology["num_nodes"]) * int(self.topology["gpus_per_node"])

    def layer_plans(self, rank: int, tokens: int) -> list[LayerPlan]:
        """The runtime's per-layer plans for a step of `tokens` per rank."""
        return [e.choice(tokens).layer_plan(rank, self.world, self.num_slots)
                for e in self.layers]

    def stack(self, tokens: int) -> tuple[LayerSpec, ...]:
        """RunConfig.stack for a step of `tokens` per rank (one LayerSpec per layer)."""
        return tuple(e.choice(tokens).spec for e in self.layers)

    def run_tokens(self, tokens: int) -> int:
        """RunConfig.tokens for `tokens` per rank: per rank when any layer is ep_dp (each rank
        holds its own rows), else the global batch every rank holds (tokens x ranks)."""
        forms = {e.choice(tokens).form for e in self.layers}
        return tokens if "ep_dp" in forms or self.world == 1 else tokens * self.world

    def stages_ms(self, tokens: int) -> dict[str, float]:
        """Predicted ms per step in each runtime stage, summed over layers: what the launch
        report's `stages_ms` measures (a step's calls summed, median over steps)."""
        out: dict[str, float] = {}
        for e in self.layers:
            for k, v in e.choice(tokens).stages_us.items():
                out[k] = out.get(k, 0.0) + v / 1e3
        return out

    def step_us(self, tokens: int) -> float:
        return sum(e.choice(tokens).predicted_us for e in self.layers)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {"schema": PLAN_SCHEMA, "model": self.model,
                "quant": {"recipe": self.quant.recipe, "scale_fmt": self.quant.scale_fmt},
                "topology": self.topology, "profile": self.profile, "scope": self.scope,
                "num_slots": self.num_slots, "buckets": list(self.buckets),
                "layers": [{"layer": e.layer,
                            "choices": [{"tokens": b, **c.to_dict()} for b, c in e.choices]}
                           for e in self.layers]}

    def to_json(self) -> str:
        return json_text(self.to_dict()) + "\n"

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("schema") != PLAN_SCHEMA:
            raise ValueError(f"plan schema {d.get('schema')!r} is not {PLAN_SCHEMA}; write the "
                             f"plan again with python -m epmoe.plan --out FILE")
        try:
            layers = tuple(LayerEntry(int(e["layer"]), tuple(
                (int(c["tokens"]), Choice.from_dict(c)) for c in e["choices"]))
                for e in d["layers"])
            plan = cls(d["model"], QuantConfig(**d["quant"]), dict(d["topology"]), d["profile"],
                       int(d["num_slots"]), tuple(int(b) for b in d["buckets"]), layers,
                       d.get("scope", "runtime"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed: missing or bad {exc}") from None
        for e in plan.layers:
            if not e.choices:
                raise ValueError(f"layer {e.layer} has no choices: one per bucket needed")
            buckets = [b for b, _ in e.choices]
            if buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:])):
                raise ValueError(f"layer {e.layer}'s buckets {buckets} must be tokens >= 1, "
                                 f"ascending")
        return plan

    @classmethod
    def load(cls, path) -> "Plan":
        d = read_doc(path, "plan file", f"; write one with python -m epmoe.plan --out {path}")
        try:
            return cls.from_dict(d)
        except ValueError as exc:
            raise ValueError(f"plan file {path!r}: {exc}") from None
