"""DeepGEMM experts: permute -> GEMM1 -> act+quant -> GEMM2 -> gather, GEMMs by DeepGEMM.

| recipe     | GEMM (deep_gemm)                              | arch  | scales DeepGEMM reads          |
|------------|-----------------------------------------------|-------|--------------------------------|
| fp8_block  | m_grouped_fp8_gemm_nt_{contiguous,masked}     | SM90  | act fp32 [M, K/128] MN-major,  |
|            |                                               |       | TMA-aligned; weight fp32       |
|            |                                               |       | [E, N/128, K/128] as stored    |
| fp8_block  | same names                                    | SM100 | act UE8M0 int32 [M, ceil(K/512)|
|            |                                               |       | ] packed MN-major; weight the  |
|            |                                               |       | same, one row per N (broadcast)|
| bf16       | m_grouped_bf16_gemm_nt_{contiguous,masked}    | SM90+ | none                           |
| mxfp8,     | m_grouped_fp8_fp4_gemm_nt_contiguous (1x32)   | SM100 | e8m0 packed int32              |
| w4a8_mxfp4 |                                               |       |                                |

Weight scales are transformed once, at construction. The hot path makes no host sync (the
layout is sized for the worst case of its pairs; DeepGEMM skips padding rows) and takes its
GEMM outputs from the object's ExpertsWorkspace. `run_dense` (shared experts, E = 1) runs
DeepGEMM's dense GEMMs on the token rows directly: no permute, no gather. The contiguous layout's groups are aligned
to DeepGEMM's M block (`get_mk_alignment_for_contiguous_layout`), so a finer alignment is
refused by `make_layout` and every layout this class builds is at the GEMM's value.
deep_gemm is imported lazily (it raises OSError, not ImportError, without libnvrtc).
"""

from __future__ import annotations

import contextlib

import torch

from epmoe.config import MoEConfig, QuantConfig
from epmoe.experts.base import ExpertWeights, Experts
from epmoe.experts.workspace import ExpertsWorkspace, fused_quantize, permute_worst_case
from epmoe.layout import ContiguousLayout
from epmoe.quant import QTensor, QWeight, _act_scale_fp32, _mn_major, _pack_exponents, pack_ue8m0

_TMA_ALIGN_FP32 = 4  # 16 bytes of fp32 / int32
SM90_RECIPE = (1, 128, 128)  # (act rows, weight rows, K) per scale
SM100_RECIPE = (1, 1, 128)  # weight scales broadcast to one per row before packing


def _deep_gemm():
    import deep_gemm  # noqa: PLC0415  (lazy: optional, CUDA-only dependency)

    return deep_gemm


def _arch_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


# --------------------------------------------------------------------------------------------
# Scale layouts (pure torch; unit-tested on CPU against DeepGEMM's documented layouts).

def sm90_act_scale(scale_MG: torch.Tensor) -> torch.Tensor:
    """fp32 [M, G] (or [E, M, G]) -> the same values MN-major, M stride padded to 4 (16 bytes):
    strides (1, align(M, 4)) / (G*align(M, 4), 1, align(M, 4)); DeepGEMM's
    get_mn_major_tma_aligned_tensor. Returned as is when already in that layout."""
    if scale_MG.dtype != torch.float32:
        raise ValueError(f"SM90 activation scales must be fp32, got {scale_MG.dtype}")
    if is_tma_mn_major(scale_MG):
        return scale_MG
    return _mn_major(scale_MG.view(torch.int32)).view(torch.float32)


def is_tma_mn_major(t: torch.Tensor) -> bool:
    """MN-major with the MN stride a multiple of 4 elements (the layout TMA loads)."""
    if t.dim() < 2:
        return False
    mn = t.shape[-2]
    return t.stride(-2) == 1 and (t.shape[-1] == 1 or t.stride(-1) % _TMA_ALIGN_FP32 == 0) \
        and t.stride(-1) >= mn


def sm100_weight_scale(scale_ENbKb: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 power-of-two block scales [E, N/128, K/128] -> UE8M0 packed int32 [E, N, ceil(K/512)],
    one row per output row (the 128-row block's scale repeated), MN-major TMA-aligned: what
    DeepGEMM's transform_sf_into_required_layout makes of (FP32, 128, 128) on SM100."""
    rows = scale_ENbKb.repeat_interleave(128, dim=1)[:, :n]
    return pack_ue8m0(rows.float().contiguous())


def sm100_act_scale(x: QTensor) -> torch.Tensor:
    """Activation scales as UE8M0 packed int32 [(E,) M, ceil(G/4)] MN-major (DeepGEMM SM100)."""
    if x.scale_fmt == "ue8m0_packed":
        return x.scale
    if x.scale.dtype == torch.uint8:  # mxfp8 e8m0 bytes
        return _pack_exponents(x.scale)
    return pack_ue8m0(x.scale.float())


def _weight_operand(w: QWeight, sm100: bool):
    """(data, scale) in the layout DeepGEMM reads, or data alone for bf16 (built once)."""
    if w.recipe == "bf16":
        return w.data.contiguous()
    if w.recipe == "fp8_block":
        if sm100:
            return w.data.contiguous(), sm100_weight_scale(w.scale, w.data.shape[1])
        return w.data.contiguous(), w.scale.float().contiguous()
    # mxfp8 / w4a8_mxfp4 (SM100): e8m0 bytes [E, N, K/32] -> packed int32
    data = w.data if w.recipe == "mxfp8" else w.data.view(torch.int8)
    return data.contiguous(), _pack_exponents(w.scale)


def arch_unsupported(cfg: MoEConfig, quant: QuantConfig, sm_arch: int,
                     inter: int | None = None) -> str | None:
    """The pure rules of this backend (no device, no import; the planner calls them too) for
    compute capability `sm_arch` x 10 (90 Hopper, 100 Blackwell) and intermediate `inter` per
    rank (default the model's; a tp shard passes its slice)."""
    inter = cfg.moe_intermediate if inter is None else inter
    if sm_arch < 90:
        return f"DeepGEMM needs SM90 or newer, device is SM{sm_arch}"
    if quant.recipe in ("mxfp8", "w4a8_mxfp4") and sm_arch < 100:
        return (f"recipe {quant.recipe} needs DeepGEMM's SM100 fp8/fp4 kernels; device is "
                f"SM{sm_arch} (use triton, or fp8_block)")
    if quant.recipe == "fp8_block" and sm_arch >= 100 and quant.scale_fmt == "fp32":
        return ("SM100 DeepGEMM reads UE8M0 scales: use scale_fmt ue8m0_fp32 or "
                "ue8m0_packed (fp32 block scales are not powers of two)")
    if quant.recipe == "fp8_block" and sm_arch < 100 and quant.scale_fmt == "ue8m0_packed":
        return "packed UE8M0 activation scales are SM100-only; use scale_fmt ue8m0_fp32 on SM90"
    try:
        quant.check_shapes(cfg, inter)
    except ValueError as exc:
        return str(exc)
    if cfg.hidden % 128 or inter % 128:
        return (f"hidden ({cfg.hidden}) and intermediate ({inter}) must be multiples of 128 "
                f"for DeepGEMM")
    return None


class DeepGemmExperts(Experts):
    """Grouped expert MLPs on DeepGEMM. `timer`: an optional epmoe.timing.StageTimer; when set
    (the layer may set it), permute / gemm1 / act_quant / gemm2 / gather are timed separately."""

    name = "deepgemm"
    timer = None
    # contiguous GEMMs in DeepGEMM's psum layout (see gemm_contiguous); False: the row-expert
    # layout (every padding tile of a worst-case-sized layout is still loaded)
    use_psum = True

    def __init__(self, weights: ExpertWeights, cfg: MoEConfig, quant: QuantConfig):
        super().__init__(weights, cfg, quant)
        why = self.supports(cfg, quant, weights.w13.data.device)
        if why:
            raise ValueError(f"experts backend 'deepgemm' cannot run here: {why}")
        if weights.w13.recipe != quant.recipe or weights.w2.recipe != quant.recipe:
            raise ValueError(f"weights are {weights.w13.recipe}/{weights.w2.recipe} but the "
                             f"recipe is {quant.recipe}; quantize them with the same QuantConfig")
        self._dg = _deep_gemm()
        self.sm100 = _arch_major(weights.w13.data.device) >= 10
        self._alignment = int(self._dg.get_mk_alignment_for_contiguous_layout())
        self.w13 = _weight_operand(weights.w13, self.sm100)
        self.w2 = _weight_operand(weights.w2, self.sm100)
        self.ws = ExpertsWorkspace(weights.w13.data.device)

    # ------------------------------------------------------------------ capability
    @classmethod
    def supports(cls, cfg: MoEConfig, quant: QuantConfig, device: torch.device) -> str | None:
        device = torch.device(device)
        if not torch.cuda.is_available() or device.type != "cuda":
            return f"device {device} is not CUDA"
        try:
            _deep_gemm()
        except (ImportError, OSError, RuntimeError) as exc:
            return f"deep_gemm unavailable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        return arch_unsupported(cfg, quant, 10 * _arch_major(device))


    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def fp8_mma(self) -> bool:
        return self.quant.recipe == "fp8_block"

    def _stage(self, name: str):
        name = "experts." + name  # same stage names as every experts backend
        return self.timer.stage(name) if self.timer is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ GEMMs
    def _act_operand(self, x: QTensor):
        if x.recipe == "bf16":
            return x.data
        if self.sm100:
            return x.data, sm100_act_scale(x)
        return x.data, sm90_act_scale(x.scale)

    def _recipe_kw(self) -> dict:
        if self.quant.recipe == "fp8_block":
            return dict(recipe=SM100_RECIPE if self.sm100 else SM90_RECIPE)
        if self.quant.recipe == "mxfp8":
            return dict(recipe_a=(1, 32), recipe_b=(1, 32))
        return dict(recipe_a=(1, 128), recipe_b=(1, 32))  # w4a8: fp8 1x128 act, fp4 1x32 wt

    def _out(self, name: str, shape) -> torch.Tensor:
        return self.ws.take(name, shape, torch.bfloat16, self.slot)

    def gemm_contiguous(self, x: QTensor, w, row_expert_M: torch.Tensor, n: int,
                        name: str = "y", psum_E: torch.Tensor | None = None) -> torch.Tensor:
        """rows x [M, K] @ w[row_expert].T -> [M, n] bf16 (padding rows: any value), written
        into the workspace buffer `name`. psum_E: int32 [E] end row of each expert's group
        (groups start at the aligned end of the previous one): DeepGEMM's psum layout, whose
        scheduler stops after the last group, so the padding of a worst-case-sized layout
        costs nothing (with row_expert alone its producer still loads every padding tile)."""
        out = self._out(name, (x.data.shape[0], n))
        layout, kw = row_expert_M, {}
        if psum_E is not None:
            layout, kw = psum_E, dict(use_psum_layout=True)
        if x.recipe == "bf16":
            self._dg.m_grouped_bf16_gemm_nt_contiguous(x.data, w, out, layout, **kw)
        else:
            self._dg.m_grouped_fp8_fp4_gemm_nt_contiguous(self._act_operand(x), w, out,
                                                          layout, **self._recipe_kw(), **kw)
        return out

    def psum(self, layout: ContiguousLayout) -> torch.Tensor | None:
        """The layout as DeepGEMM's psum layout (int32 [E], on the device: no sync), or None
        when its groups are aligned coarser than DeepGEMM's M block (then they would not start
        where the psum layout puts them)."""
        if not self.use_psum or layout.alignment != self.alignment:
            return None
        ws = self.ws.take("psum", (layout.num_experts,), torch.int32, self.slot)
        return torch.add(layout.offsets_E1[:-1], layout.counts_E, out=ws)

    def gemm_masked(self, x: QTensor, w, counts_E: torch.Tensor, n: int,
                    expected_m: int, name: str = "y") -> torch.Tensor:
        e, c, _ = x.data.shape
        out = self._out(name, (e, c, n))
        if x.recipe == "bf16":
            self._dg.m_grouped_bf16_gemm_nt_masked(x.data, w, out, counts_E, expected_m)
        else:
            self._dg.m_grouped_fp8_fp4_gemm_nt_masked(self._act_operand(x), w, out, counts_E,
                                                      expected_m, **self._recipe_kw())
        return out

    def gemm_dense(self, x: QTensor, w, n: int, name: str = "y") -> torch.Tensor:
        """x [N, K] @ w[0].T -> [N, n] bf16 (expert 0 of the operand; DeepGEMM's dense GEMM)."""
        out = self._out(name, (x.data.shape[0], n))
        if x.recipe == "bf16":
            self._dg.bf16_gemm_nt(x.data, w[0], out)
        else:
            self._dg.fp8_fp4_gemm_nt(self._act_operand(x), (w[0][0], w[1][0]), out,
                                     **self._recipe_kw())
        return out

    def _act_quant(self, h: torch.Tensor, mn_major: bool | None = None,
                   rows=None) -> QTensor:
        """SwiGLU + the recipe's quantization in one Triton kernel; SM90 scales come out in
        DeepGEMM's MN-major TMA layout directly (no relayout copy). rows: the `ValidRows`
        holding data (the padding rows are skipped)."""
        from epmoe.kernels.act_quant import triton_act_quant

        mn = (not self.sm100) if mn_major is None else mn_major
        return triton_act_quant(h, self.cfg, self.quant, mn_major=mn, rows=rows,
                                bias_EF=self.weights.b13)

    # ------------------------------------------------------------------ the contract
    def make_layout(self, topk_ids_NK: torch.Tensor, alignment: int | None = None,
                    num_rows: int | None = None) -> ContiguousLayout:
        from epmoe.kernels.permute import triton_make_contiguous_layout

        a = self.resolve_alignment(alignment)
        return triton_make_contiguous_layout(topk_ids_NK, self.weights.num_experts, a,
                                             num_rows=num_rows)

    def apply(self, x: QTensor, topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor | None,
              alignment: int | None = None) -> torch.Tensor:
        from epmoe.kernels.gather import triton_unpermute_reduce

        a = self.resolve_alignment(alignment)
        with self._stage("permute"):
            xp, layout = permute_worst_case(x, topk_ids_NK, self.weights.num_experts, a,
                                            self.ws, self.slot)
        y = self.run_contiguous(xp, layout)
        with self._stage("gather"):
            return triton_unpermute_reduce(y, layout, topk_weights_NK)

    def quantize_input(self, x_TD: torch.Tensor) -> QTensor:
        """SM90: fp32 scales straight into DeepGEMM's MN-major TMA layout (no relayout)."""
        return fused_quantize(x_TD, self.quant, mn_major=not self.sm100)

    def run_dense(self, x: QTensor) -> torch.Tensor:
        """Every row through expert 0 (the shared MLP): x [N, D] -> [N, D] bf16."""
        self.check_one_expert()
        i, d = self.weights.intermediate, self.weights.hidden
        h = self.gemm_dense(x, self.w13, 2 * i, name="h")
        y = self.gemm_dense(self._act_quant(h), self.w2, d, name="y")
        return _add_down_bias(y, self.weights, None)

    def run_contiguous(self, x: QTensor, layout: ContiguousLayout) -> torch.Tensor:
        if layout.alignment % self.alignment:
            raise ValueError(f"layout alignment ({layout.alignment}) must be a multiple of "
                             f"DeepGEMM's M block ({self.alignment}); build it with make_layout")
        i, d = self.weights.intermediate, self.weights.hidden
        with self._stage("gemm1"):
            psum = self.psum(layout)
            h = self.gemm_contiguous(x, self.w13, layout.row_expert_M, 2 * i, "h", psum)
        rows = _valid_rows().contiguous(layout.row_expert_M)
        with self._stage("act_quant"):
            a = self._act_quant(h, rows=rows)
        with self._stage("gemm2"):
            y = self.gemm_contiguous(a, self.w2, layout.row_expert_M, d, "y", psum)
            return _add_down_bias(y, self.weights, rows)

    def run_masked(self, x: QTensor, counts_E: torch.Tensor,
                   expected_m: int | None = None) -> torch.Tensor:
        """expected_m: DeepGEMM's tuning hint (rows per expert); default min(C, 128). The mean
        count would need a host sync; a fixed hint keeps this path CUDA-graph safe."""
        e, c, _ = x.data.shape
        counts_E = counts_E.to(torch.int32).contiguous()
        m_hint = expected_m or max(1, min(c, 128))
        i, d = self.weights.intermediate, self.weights.hidden
        with self._stage("gemm1"):
            h = self.gemm_masked(x, self.w13, counts_E, 2 * i, m_hint, name="h")
        rows = _valid_rows().masked(counts_E, c)
        with self._stage("act_quant"):
            a = self._act_quant(h.view(e * c, 2 * i), mn_major=False, rows=rows)
            s = a.scale
            if s is not None:  # per-expert TMA layout: [E, C, G] with C the unit stride
                s = _act_scale_fp32(a).view(e, c, -1)
                s = pack_ue8m0(s) if self.sm100 else sm90_act_scale(s)
            a = QTensor(a.data.view(e, c, -1), s, a.recipe, a.group,
                        "ue8m0_packed" if self.sm100 and s is not None else a.scale_fmt)
        with self._stage("gemm2"):
            y = self.gemm_masked(a, self.w2, counts_E, d, m_hint, name="y")
            return _add_down_bias(y, self.weights, rows)


def _add_down_bias(y: torch.Tensor, weights: ExpertWeights, rows) -> torch.Tensor:
    """GEMM2's bf16 output + each valid row's b2, in place (DeepGEMM has no epilogue hook:
    one pass, `kernels.expert_bias`); y unchanged without b2. rows: y's `ValidRows`."""
    if weights.b2 is None:
        return y
    from epmoe.kernels.expert_bias import triton_add_expert_bias_

    return triton_add_expert_bias_(y, weights.b2, rows)


def _valid_rows():
    """`ValidRows`, imported when a kernel runs (the Triton kernels' module loads triton)."""
    from epmoe.kernels.act_quant import ValidRows

    return ValidRows


__all__ = ["DeepGemmExperts", "sm90_act_scale", "sm100_weight_scale", "sm100_act_scale",
           "is_tma_mn_major"]
