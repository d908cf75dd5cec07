"""Synthetic routing (top-k expert ids) for EPLB runs, and trace record/replay.

`make_routing(spec, num_layers, num_experts, top_k, num_tokens, step, seed)` returns int64
`topk_ids_LTK` [L, T, K] with K distinct experts per token. Spec grammar:

    uniform        every expert equally likely
    zipf:S         per layer, popularity of the expert ranked r is r**-S (S >= 0) over a
                   per-layer random permutation of the experts (fixed by seed, not by step)
    drift:S:P      zipf:S whose ranking rotates by one expert every P steps (P >= 1)
    trace:FILE     replay a recorded trace; step s uses recorded step s % S

Tokens draw K experts without replacement, weighted by popularity (`torch.multinomial`),
seeded by (seed, step), so a (spec, shape, step, seed) tuple always gives the same ids.

Trace file: a `.pt` (torch.save of a dict) or `.safetensors` file holding one tensor
`topk_ids`, integer [S, L, T, K] = (steps, layers, tokens, top_k). `save_trace` writes it
(format chosen by the suffix), `load_trace` reads it back as int64.
"""

from __future__ import annotations

from pathlib import Path

import torch

GRAMMAR = "uniform | zipf:S | drift:S:P | trace:FILE"


def make_routing(spec: str, num_layers: int, num_experts: int, top_k: int, num_tokens: int,
                 step: int, seed: int) -> torch.Tensor:
    """int64 topk_ids [L, T, K] for one step; experts distinct within each token."""
    for name, v in (("num_layers", num_layers), ("num_experts", num_experts),
                    ("top_k", top_k), ("num_tokens", num_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} ({v!r}) must be a positive int")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts}): experts "
                         f"are distinct per token")
    kind, _, rest = spec.partition(":")
    if kind == "trace":
        if not rest:
            raise ValueError(f"routing spec {spec!r}: trace needs a file; grammar: {GRAMMAR}")
        return _replay(load_trace(rest), num_layers, num_experts, top_k, num_tokens, step)
    if kind == "uniform" and not rest:
        pop_LE = torch.ones(num_layers, num_experts, dtype=torch.float64)
    elif kind == "zipf":
        (s,) = _numbers(spec, rest, 1)
        pop_LE = _zipf(num_layers, num_experts, s, 0, seed)
    elif kind == "drift":
        s, p = _numbers(spec, rest, 2)
        if p < 1 or p != int(p):
            raise ValueError(f"routing spec {spec!r}: drift period P ({p}) must be an int >= 1; "
                             f"grammar: {GRAMMAR}")
        pop_LE = _zipf(num_layers, num_experts, s, step // int(p), seed)
    else:
        raise ValueError(f"routing spec {spec!r} is not understood; grammar: {GRAMMAR}")
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (1 << 63))
    probs = pop_LE.repeat_interleave(num_tokens, 0)  # [L*T, E]
    ids = torch.multinomial(probs, top_k, replacement=False, generator=gen)
    return ids.view(num_layers, num_tokens, top_k)


def save_trace(path, topk_ids_SLTK: torch.Tensor) -> None:
    """Write a trace [S, L, T, K] to `path` (.safetensors, else torch.save)."""
    if topk_ids_SLTK.dim() != 4 or topk_ids_SLTK.is_floating_point():
        raise ValueError(f"topk_ids must be an integer tensor [steps, layers, tokens, top_k], "
                         f"got {topk_ids_SLTK.dtype} of shape {tuple(topk_ids_SLTK.shape)}")
    t = topk_ids_SLTK.detach().cpu().to(torch.int64).contiguous()
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({"topk_ids": t}, str(path))
    else:
        torch.save({"topk_ids": t}, path)


def load_trace(path) -> torch.Tensor:
    """Read a trace written by `save_trace` (or any file with that layout) as int64 [S, L, T, K]."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist; record one with save_trace")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            d = load_file(str(p))
        else:
            d = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, empty, a pickle of something else (some are ValueErrors)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "weights_only" in first or "Weights only load failed" in first:  # torch's advice
            first = "not a torch.save file of tensors"  # (weights_only=False) is not ours
        raise ValueError(f"trace file {str(p)!r} cannot be read ({type(e).__name__}: {first}); "
                         f"write it with epmoe.eplb.routing.save_trace: a .pt or .safetensors "
                         f"file holding 'topk_ids' [steps, layers, tokens, top_k]") from None
    if not isinstance(d, dict) or not isinstance(d.get("topk_ids"), torch.Tensor):
        raise ValueError(f"trace file {str(p)!r} must hold a tensor named 'topk_ids' "
                         f"[steps, layers, tokens, top_k]")
    t = d["topk_ids"]
    if t.dim() != 4:
        raise ValueError(f"trace 'topk_ids' must be 4-D [steps, layers, tokens, top_k], got "
                         f"shape {tuple(t.shape)}")
    return t.to(torch.int64)


def trace_loads(trace_SLTK: torch.Tensor, num_experts: int,
                steps: int | None = None) -> torch.Tensor:
    """float64 [L, E]: each expert's selections per layer over the steps a run of `steps`
    steps replays from the trace (step s replays recorded step s % S); None: each recorded
    step once. Ids must lie in [0, num_experts)."""
    S = trace_SLTK.shape[0]
    times = torch.ones(S, dtype=torch.long) if steps is None else \
        torch.bincount(torch.arange(steps) % S, minlength=S)
    loads = torch.zeros(trace_SLTK.shape[1], num_experts, dtype=torch.float64)
    for s in times.nonzero().flatten().tolist():
        for l in range(trace_SLTK.shape[1]):
            loads[l] += float(times[s]) * torch.bincount(trace_SLTK[s, l].flatten(),
                                                         minlength=num_experts)
    return loads


def _numbers(spec: str, rest: str, n: int) -> list[float]:
    parts = rest.split(":") if rest else []
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        vals = []
    if len(vals) != n or any(v < 0 or v != v for v in vals):
        raise ValueError(f"routing spec {spec!r} needs {n} number(s) >= 0 after the kind; "
                         f"grammar: {GRAMMAR}")
    return vals


def _zipf(L: int, E: int, s: float, shift: int, seed: int) -> torch.Tensor:
    """fp64 [L, E]: rank r -> r**-s popularity; expert perm_l[(r + shift) % E] has rank r."""
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    perm_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    perm_LE = perm_LE.roll(-shift, dims=1)
    rank_pop = torch.arange(1, E + 1, dtype=torch.float64) ** -s
    pop = torch.empty(L, E, dtype=torch.float64)
    pop.scatter_(1, perm_LE, rank_pop.expand(L, E).contiguous())
    return pop


def _replay(trace_SLTK, L, E, K, T, step) -> torch.Tensor:
    S, tl, tt, tk = trace_SLTK.shape
    if (tl, tt, tk) != (L, T, K):
        raise ValueError(f"trace shape (layers, tokens, top_k) = {(tl, tt, tk)} must match the "
                         f"request {(L, T, K)}; record the trace with the run's shape")
    ids = trace_SLTK[step % S]
    if ids.numel() and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"trace expert ids span [{int(ids.min())}, {int(ids.max())}] but must "
                         f"lie in [0, {E}) for num_experts ({E})")
    return ids.clone()
