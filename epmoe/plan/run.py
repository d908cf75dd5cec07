"""`RunConfig`: everything a run needs, as data, validated before any worker starts.

The launcher builds one from its flags (or the planner's plan: `stack`, one `LayerSpec` per
layer, and `tokens`), hands it to every rank's `epmoe.runtime.Runtime`, and the report reads
it back. It owns the token-layout rule of mixed stacks (`own_tokens`, `layer_tokens`,
`token_offset`) and maps each layer to its `LayerPlan` (epmoe.plan.forms).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from epmoe.config import MoEConfig, QuantConfig, get_preset
from epmoe.eplb.decision import MigrationLinks
from epmoe.plan.forms import LayerPlan, LayerSpec


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs; validated before any worker starts."""

    model: str = "deepseek-v3-tiny"  # a preset, or the config.json `model_config` came from
    # a model read from a config.json by the launcher (epmoe.hf_config), so no rank reads files
    model_config: MoEConfig | None = None
    # a Hugging Face checkpoint folder (safetensors + config.json) the layers' weights are read
    # from, on every rank (a cluster: a path every node sees); None = synthetic weights
    weights: str | None = None
    quant: QuantConfig = field(default_factory=QuantConfig)
    form: str = "ep_dp"  # tp | ep | ep_dp
    world: int = 1
    backend: str = "auto"
    ll_max_tokens: int = 256  # auto backend: DeepEP low-latency up to this many tokens per rank
    experts: str = "auto"
    tokens: int = 64  # per rank (ep_dp) or in total (tp / ep: replicated)
    layers: int | None = None  # None = the preset's num_moe_layers
    steps: int = 4
    seed: int = 0
    routing: str = "router"  # router | uniform | zipf:S | drift:S:P | trace:FILE
    redundant_experts: int = 0
    eplb: bool = False
    eplb_window: int = 8  # steps of load history a rebalance looks at
    timeout_s: float = 120.0
    # starting the ranks (placement, actors up: imports and CUDA init; the process group) is
    # slower than any step on a cold cluster; a hung start is still caught at this bound
    start_timeout_s: float = 300.0
    check: bool = True  # keep last-step tensors for the oracle
    model_overrides: tuple = ()  # ((field, value), ...) applied to the preset
    micro_batches: int = 1  # 2: one half's dispatch/combine overlaps the other's GEMMs
    # per-layer LayerSpec (a mixed stack: plan file or planner); () = every layer runs
    # `form` with `backend` and `experts`
    stack: tuple = ()
    eplb_migration: str = "sync"  # sync | async (weights staged in the background)
    # launched: a step is the host's wall time from a synchronize to the next, stage events
    # as the launches reach the GPU (host-bound stages hold the host's time); device: the GPU
    # is kept busy while the host issues the step (a device sleep first), so the step and
    # its stages are GPU time, and the host's issue time is reported beside them
    timing: str = "launched"
    eplb_link_gbps: float | None = None  # rebalance cost model: one figure for every link
    eplb_links: MigrationLinks | None = None  # the launcher's, from its profile and topology
    # ranks sharing each GPU (> 1: time-sliced by the driver, a gloo process group, symm-*
    # only): a check of a multi-rank run on fewer GPUs, never a speed
    ranks_per_gpu: int = 1
    # steps 1.. replayed from one CUDA graph per rank (epmoe/graph.py: capturable paths only)
    cuda_graph: bool = False
    # ((SymmOptions knob, value), ...): the symm-ht / symm-ll layers' options (--comm-option)
    comm_options: tuple = ()

    @property
    def cfg(self) -> MoEConfig:
        cfg = self.model_config if self.model_config is not None else get_preset(self.model)
        if self.model_overrides:
            cfg = cfg.replace(**dict(self.model_overrides))
        return cfg

    @property
    def num_layers(self) -> int:
        n = self.cfg.num_moe_layers if self.layers is None else self.layers
        if n < 1:
            raise ValueError(f"layers ({n}) must be >= 1")
        return n

    # ------------------------------------------------------------ the stack, layer by layer
    def layer_spec(self, l: int) -> LayerSpec:
        if self.stack:
            return self.stack[l]
        return LayerSpec(self.form, self.backend, self.experts)

    @property
    def forms(self) -> tuple[str, ...]:
        return tuple(self.layer_spec(l).form for l in range(self.num_layers))

    @property
    def mixed(self) -> bool:
        return len(set(self.forms)) > 1

    # The one owner of the token-layout rule: when any layer is ep_dp, every rank holds its own
    # `tokens` rows and a replicated layer (tp / ep) sees all ranks' rows gathered; when no layer
    # is, `tokens` is the one batch every rank holds.
    @property
    def own_tokens(self) -> bool:
        return "ep_dp" in self.forms

    @property
    def global_tokens(self) -> int:
        """Tokens of one step over all ranks."""
        return self.tokens * self.world if self.own_tokens else self.tokens

    def holds_own_rows(self, l: int) -> bool:
        """Layer l runs on this rank's own rows (ep_dp, or one rank), not the gathered batch."""
        return self.world == 1 or self.layer_spec(l).form == "ep_dp"

    def layer_tokens(self, l: int) -> int:
        return self.tokens if self.holds_own_rows(l) and self.own_tokens else self.global_tokens

    def token_offset(self, l: int, rank: int) -> int:
        """Global index of the first row layer l sees on `rank`."""
        return rank * self.tokens if self.holds_own_rows(l) and self.own_tokens else 0

    def layer_plan(self, l: int, rank: int, backend: str) -> LayerPlan:
        spec = self.layer_spec(l)
        return LayerPlan(form=spec.form, rank=rank, world=self.world,
                         backend=backend if spec.form == "ep_dp" or self.world == 1 else "local",
                         experts=spec.experts,
                         num_slots=self.cfg.num_experts + self.redundant_experts)

    def validate(self) -> None:
        if self.world < 1:
            raise ValueError(f"world ({self.world}) must be >= 1")
        if self.tokens < 1:
            raise ValueError(f"tokens ({self.tokens}) must be >= 1")
        if self.steps < 1:
            raise ValueError(f"steps ({self.steps}) must be >= 1")
        if self.timing not in ("launched", "device"):
            raise ValueError(f"timing ({self.timing!r}) must be 'launched' or 'device'")
        if self.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu ({self.ranks_per_gpu}) must be >= 1")
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches ({self.micro_batches}) must be 1 or 2")
        n = self.num_layers
        if self.stack:
            if len(self.stack) != n:
                raise ValueError(f"the stack plan has {len(self.stack)} layer entries but the run "
                                 f"has {n} layers; give one entry per layer (or set --layers)")
            for spec in self.stack:
                if not isinstance(spec, LayerSpec):
                    raise ValueError(f"stack entries must be LayerSpec, got {spec!r}")
            if self.eplb and "tp" in self.forms:
                raise ValueError("--eplb places experts across EP ranks, but the plan has tp "
                                 "layers; plan those layers as ep or ep_dp")
        for l in range(n):
            # (LayerPlan's own rules too: e.g. ep_dp with a backend that moves no tokens)
            self.layer_plan(l, 0, self.layer_spec(l).backend).validate(self.cfg, self.quant)
        if self.cuda_graph:
            self._validate_cuda_graph()

    def _validate_cuda_graph(self) -> None:
        from epmoe.graph import capture_violation

        if self.steps < 2:  # step 0 runs eagerly (it compiles); steps 1.. are replayed
            raise ValueError(f"--cuda-graph replays steps 1..; with --steps {self.steps} no "
                             f"step would be replayed: give --steps 2 or more")
        for l in range(self.num_layers):
            spec = self.layer_spec(l)
            why = capture_violation(spec.form, spec.backend, spec.experts)
            if why:
                raise ValueError(f"layer {l}: {why}")

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)
