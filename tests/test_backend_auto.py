"""`--backend auto`: LL below the token threshold, HT above, all2all with the reason when DeepEP
cannot run (always the case on this CPU machine)."""

import pytest
import torch

from epmoe.comm import resolve_backend
from epmoe.launch.cli import build_run, parser
from epmoe.runtime import RunConfig


@pytest.mark.parametrize("tokens,ll_max,first", [(64, 256, "deepep-ll"), (256, 256, "deepep-ll"),
                                                 (512, 256, "deepep-ht"), (64, 32, "deepep-ht")])
def test_auto_tries_ll_then_ht_by_threshold_and_falls_back(tokens, ll_max, first):
    run = RunConfig(world=2, tokens=tokens, ll_max_tokens=ll_max)
    name, reason = resolve_backend("auto", run, torch.device("cuda"))
    assert name == "all2all"  # no DeepEP here
    assert reason.startswith(f"auto: all2all ({first}: "), reason
    other = {"deepep-ll": "deepep-ht", "deepep-ht": "deepep-ll"}[first]
    assert other not in reason


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
