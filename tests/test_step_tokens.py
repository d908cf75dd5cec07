"""Each step's input tokens (epmoe/step_tokens.py): one Gaussian batch drawn once, reordered
and sign-flipped per step on the device, the same on every rank for the same source."""

import torch

from epmoe.step_tokens import StepTokens

CPU = torch.device("cpu")


def test_the_same_seed_and_source_give_the_same_batch_everywhere():
    a, b = StepTokens(64, 32, 3, 0, CPU), StepTokens(64, 32, 3, 0, CPU)
    for step in (0, 1, 7):
        assert torch.equal(a(step), b(step))  # another rank's instance, the same batch
        assert torch.equal(a(step), a(step))
    assert not torch.equal(a(0), a(1))  # another step
    assert not torch.equal(a(0), StepTokens(64, 32, 3, 1, CPU)(0))  # another rank's own rows
    assert not torch.equal(a(0), StepTokens(64, 32, 4, 0, CPU)(0))  # another seed
    assert a(0).shape == (64, 32) and a(0).dtype == torch.bfloat16


def test_a_step_is_the_base_batch_reordered_with_column_signs():
    t = StepTokens(48, 16, 0, 0, CPU)
    base, x = t.base().float(), t(5).float()
    # every step row is some base row with one sign per column (the same signs for all rows)
    rows = [int(torch.nonzero((x[i].abs()[None] == base.abs()).all(1))[0]) for i in range(48)]
    assert sorted(rows) == list(range(48))  # a permutation of the base rows
    col_signs = torch.sign(x[0] / base[rows[0]])
    assert torch.equal(x, base[rows] * col_signs) and set(col_signs.tolist()) <= {-1.0, 1.0}


def test_steps_look_like_fresh_gaussian_batches():
    """Routing sees fresh tokens: two steps' batches are uncorrelated, each one standard."""
    t = StepTokens(256, 128, 1, 0, CPU)
    x0, x1 = t(0).float(), t(1).float()
    assert abs(x0.mean().item()) < 0.02 and abs(x0.std().item() - 1) < 0.02
    corr = torch.corrcoef(torch.stack([x0.flatten(), x1.flatten()]))[0, 1].item()
    assert abs(corr) < 0.02
    w = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    top0, top1 = (x0 @ w).argmax(1), (x1 @ w).argmax(1)  # a router's first choice per token
    assert (top0 != top1).float().mean() > 0.6  # not the same routing again


def test_the_batch_is_drawn_once_not_every_step(monkeypatch):
    """The point of it: a step draws tokens + hidden numbers on the host, not the batch."""
    t = StepTokens(512, 256, 0, 0, CPU)
    draws = []
    real = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: draws.append(a) or real(*a, **k))
    for step in range(5):
        t(step)
    assert draws == [(512, 256)]


def test_the_runtime_takes_its_steps_tokens_from_it():
    from epmoe.plan.run import RunConfig
    from epmoe.runtime import Runtime

    run = RunConfig(model="deepseek-v3-tiny", tokens=8, layers=1, steps=1, check=False, seed=2)
    rt = Runtime(run, device="cpu")
    try:
        want = StepTokens(8, rt.cfg.hidden, 2, 0, CPU)
        assert torch.equal(rt.tokens_for(3), want(3))
    finally:
        rt.close()
