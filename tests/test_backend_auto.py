"""`--backend auto` without a measured table for the run (the fixed rule): LL below the token
threshold, HT above, all2all with the reason when DeepEP cannot run. True with and without
DeepEP installed: the DeepEP answer is either the machine's own (asked through the explicit-
request path) or stubbed both ways. The shipped table (two H200) and its picks: the last
test."""

import pytest
import torch

from epmoe.comm import backend_class, resolve_backend
from epmoe.launch.cli import build_run, parser
from epmoe.plan.run import RunConfig


@pytest.fixture(autouse=True)
def no_table(request, monkeypatch):
    """The fixed rule's tests run as on a machine kind the shipped table does not describe."""
    if "shipped_table" not in request.node.name:
        monkeypatch.setattr("epmoe.comm.auto.load_table", lambda *a, **k: None)


CASES = [(64, 256, "deepep-ll"), (256, 256, "deepep-ll"), (512, 256, "deepep-ht"),
         (64, 32, "deepep-ht")]
OTHER = {"deepep-ll": "deepep-ht", "deepep-ht": "deepep-ll"}


def _why_not(name, run, device) -> str | None:
    """None if the explicitly requested backend can run here, else its reason."""
    try:
        resolve_backend(name, run, device)
    except ValueError as exc:
        return str(exc)
    return None


def _check_choice(name, reason, first, run, runnable):
    if runnable:
        assert name == first, (name, reason)
        assert reason.startswith(f"auto: {first} ({run.tokens} tokens/rank"), reason
    else:
        assert name == "all2all", (name, reason)
        assert reason.startswith("auto: all2all (") and f"; {first}: " in reason, reason
    assert OTHER[first] not in reason


@pytest.mark.parametrize("tokens,ll_max,first", CASES)
def test_auto_tries_ll_then_ht_by_threshold_and_falls_back(tokens, ll_max, first):
    run = RunConfig(world=2, tokens=tokens, ll_max_tokens=ll_max)
    dev = torch.device("cuda")
    name, reason = resolve_backend("auto", run, dev)
    _check_choice(name, reason, first, run, _why_not(first, run, dev) is None)


@pytest.mark.parametrize("runnable", [True, False], ids=["deepep-runs", "deepep-cannot"])
@pytest.mark.parametrize("tokens,ll_max,first", CASES)
def test_auto_choice_with_deepep_stubbed(tokens, ll_max, first, runnable, monkeypatch):
    """Both worlds on every machine: DeepEP's capability answer stubbed to yes / no."""
    for backend in OTHER:
        monkeypatch.setattr(backend_class(backend), "supports",
                            classmethod(lambda cls, *a, **k: None if runnable else "stubbed out"))
    run = RunConfig(world=2, tokens=tokens, ll_max_tokens=ll_max)
    name, reason = resolve_backend("auto", run, torch.device("cuda"))
    _check_choice(name, reason, first, run, runnable)
    if not runnable:
        assert reason.startswith("auto: all2all (") and \
            reason.endswith(f"; {first}: stubbed out)"), reason


def test_auto_on_cpu_is_all2all_without_trying_deepep():
    name, reason = resolve_backend("auto", RunConfig(world=2), torch.device("cpu"))
    assert (name, reason) == ("all2all", "auto: all2all")


def test_ll_threshold_flag_reaches_the_run_and_is_validated():
    assert build_run(parser().parse_args(["--ep", "2", "--ll-max-tokens", "64"])).ll_max_tokens == 64
    with pytest.raises(ValueError, match=r"--ll-max-tokens \(0\) must be >= 1"):
        build_run(parser().parse_args(["--ll-max-tokens", "0"]))


def test_requested_backend_that_cannot_run_names_why():
    with pytest.raises(ValueError, match="backend 'deepep-ht' cannot run here"):
        resolve_backend("deepep-ht", RunConfig(world=2), torch.device("cpu"))


def test_shipped_table_picks_the_measured_fastest_and_says_where_it_was_measured():
    from epmoe.comm.auto import load_table, pick

    table = load_table()
    assert table["world"] == 2 and "2 x NVIDIA H200" in table["measured"]
    every = ["all2all", "deepep-ht", "deepep-ll", "symm-ht", "symm-ll"]
    for tokens, recipe in ((128, "bf16"), (4096, "fp8_block"), (8192, "bf16")):
        name, why = pick(every, recipe, 2, tokens, table)
        times = {n: [us for t, us in table["entries"][n][recipe] if t == tokens]
                 for n in every if recipe in table["entries"].get(n, {})}
        fastest = min((v[0], n) for n, v in times.items() if v)[1]
        assert name == fastest and why.startswith(f"auto: {name} ({tokens} tokens/rank")
        assert "device timing" in why
    assert pick(every, "bf16", 8, 128, table) is None  # another world: the fixed rule
