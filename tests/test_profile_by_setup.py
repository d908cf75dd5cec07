"""The profile a launch predicts with when none is given: the measured one of the run's
setup (GPU kind, ranks on one node, timing) where one ships, the spec one elsewhere."""

from epmoe.launch.cli import build_run, parser
from epmoe.launch.device_profile import profile_for_device
from epmoe.launch.planning import prepare


def _args(*flags):
    return parser().parse_args(["--model", "deepseek-v3-tiny", *flags])


def test_a_measured_profile_where_one_ships_for_the_setup():
    h200 = "cuda (NVIDIA H200, visible 0)"
    assert profile_for_device(h200, 90, 1)[0] == "h200-calibrated"
    assert profile_for_device(h200, 90, 1, timing="device")[0] == "h200-device-timed"
    assert profile_for_device(h200, 90, 2)[0] == "h200x2-calibrated"
    assert profile_for_device(h200, 90, 2, nodes=2)[0] == "h200"  # no link measured
    assert profile_for_device(h200, 90, 8)[0] == "h200"
    assert profile_for_device(h200, 90, 2, timing="device")[0] == "h200"
    h100 = "NVIDIA H100 80GB HBM3"
    assert profile_for_device(h100, 90, 1)[0] == "h100-calibrated"
    assert profile_for_device(h100, 90, 1, timing="device")[0] == "h100-device-timed"
    assert profile_for_device(h100, 90, 2, timing="device")[0] == "h100"
    assert profile_for_device("cpu", 0, 1) == ("cpu", None)


def test_ranks_on_h200s_predict_with_the_profile_measured_for_their_setup():
    """The driver (CPU here) plans with cpu; ranks that report H200s switch the profile to the
    one measured for the run's shape: two ranks on one node h200x2-calibrated, two nodes the
    spec h200 (no inter-node figure was measured)."""
    gpu = "cuda (NVIDIA H200, visible 0)"
    for nodes, want in (("aa", "h200x2-calibrated"), ("ab", "h200")):
        launch = prepare(_args("--plan", "auto", "--ep", "2", "--tokens", "8", "--layers",
                               "2"), build_run)
        assert launch.planning.profile.name == "cpu"
        launch.at_where([dict(node_id=n, device=gpu) for n in nodes])
        assert launch.planning.profile.name == want
        assert any(f"profile {want}: by the ranks' device" in n and "2 rank(s)" in n
                   for n in launch.planning.notes)
