"""Some tables of a profile refreshed from a fresh calibration (`epmoe.plan.refresh`), and the
machine paths kept out of provenance notes (`epmoe.plan.figures.public_note`)."""

import json

import pytest

from epmoe.plan.figures import public_note
from epmoe.plan.profile import HOST_OP, AlphaBeta, Figure, Provenance, load_profile
from epmoe.plan.refresh import main, refresh, timing_of


def _calibrated(desc: str, host_us: float, router: dict, local: dict | None = None):
    base = load_profile("h100")
    kern = {**base.kernels, "router": router}
    if local is not None:
        kern["local"] = local
    return base.replace(name="x", description=desc, kernels=kern,
                        device={**base.device, HOST_OP: Figure(host_us, Provenance("measured",
                                                                                     "h"))})


def _m(note="old"):
    return Provenance("measured", note)


OLD = "calibrated on H100, 2026-12-05, python -m epmoe.bench.calibrate --out a.json --timing "
NEW = "calibrated on H100, 2026-12-07, python -m epmoe.bench.calibrate --out /root/o/b.json "


def test_refresh_takes_the_measured_fits_at_the_profiles_host_and_keeps_the_rest():
    """The fresh router fits replace the old ones of their names, at the old profile's host
    (the fresh host is 1.25x as fast per op: its host part scales by 1.25; the queued twin,
    GPU time, does not); a router kind the fresh run did not measure is kept and listed;
    other tables are untouched; notes and the description lose the machine path."""
    old = _calibrated(OLD + "launched", 10.0,
                      {"sigmoid_grouped": AlphaBeta(270.0, 900.0, _m(), 250.0),
                       "sigmoid_grouped.queued": AlphaBeta(70.0, 1e3, _m(), 110.0),
                       "softmax": AlphaBeta(100.0, 1e3, _m())},
                      {"combine": AlphaBeta(14.0, 1e4, _m())})
    note = "H100, 2026-12-07, python -m epmoe.bench.calibrate --out /root/o/b.json"
    fresh = _calibrated(NEW + "--timing launched", 8.0,
                        {"sigmoid_grouped": AlphaBeta(260.0, 1e9, _m(note), 150.0),
                         "sigmoid_grouped.queued": AlphaBeta(14.0, 2e3, _m(note), 16.0),
                         "spec_only": AlphaBeta(1.0, 1.0, Provenance("spec", "s"))},
                        {"combine": AlphaBeta(22.0, 1e4, _m(note))})
    r = refresh(old, fresh, ("router",))
    assert r.host_factor == pytest.approx(1.25)
    assert r.taken == ("router.sigmoid_grouped", "router.sigmoid_grouped.queued")
    assert r.kept == ("router.softmax",)
    got = r.profile.kernels["router"]
    q = got["sigmoid_grouped.queued"]
    assert (q.alpha_us, q.beta_GBps, q.floor_us) == (14.0, 2e3, 16.0)
    p = got["sigmoid_grouped"]  # alpha 14 + 246 x 1.25, floor 16 + 134 x 1.25
    assert p.alpha_us == pytest.approx(14.0 + 246.0 * 1.25)
    assert p.floor_us == pytest.approx(16.0 + 134.0 * 1.25)
    assert got["softmax"] == old.kernels["router"]["softmax"] and "spec_only" not in got
    assert r.profile.kernels["local"] == old.kernels["local"]
    assert r.profile.host_op_us == 10.0  # it still describes its own host
    assert "/root" not in p.prov.note and "b.json" in p.prov.note
    assert "x1.250" in p.prov.note
    assert r.profile.description.startswith(old.description)
    assert "the router fits refreshed" in r.profile.description
    assert "/root" not in r.profile.description
    assert old.kernels["router"]["sigmoid_grouped"].alpha_us == 270.0  # not mutated
    # names: only those fits and the ones named below them
    r = refresh(old, fresh, ("router",), names=("sigmoid_grouped.queued",))
    assert r.taken == ("router.sigmoid_grouped.queued",)
    assert r.profile.kernels["router"]["sigmoid_grouped"] == \
        old.kernels["router"]["sigmoid_grouped"]
    assert "the router sigmoid_grouped.queued fits refreshed" in r.profile.description
    r = refresh(old, fresh, ("router",), names=("sigmoid_grouped",))
    assert len(r.taken) == 2
    with pytest.raises(ValueError, match="measured none of the router fits named sigmoid$"):
        refresh(old, fresh, ("router",), names=("sigmoid",))


def test_refresh_refuses_what_does_not_mix():
    r = {"sigmoid_grouped": AlphaBeta(1.0, 1.0, _m())}
    launched = _calibrated(OLD + "launched", 8.0, r)
    device = _calibrated(OLD + "device", 8.0, r)
    with pytest.raises(ValueError, match="timed launched.*device"):
        refresh(launched, device, ("router",))
    with pytest.raises(ValueError, match="no mlpx fits"):
        refresh(launched, launched, ("mlpx",))
    with pytest.raises(ValueError, match="no tables"):
        refresh(launched, launched, ())
    with pytest.raises(ValueError, match="h200 profile, --into a h100 one .--across"):
        refresh(launched, load_profile("h200"), ("router",))
    with pytest.raises(ValueError, match="both are h100"):
        refresh(launched, launched, ("router",), across="same SM")
    spec_only = _calibrated(OLD + "launched", 8.0, {"x": AlphaBeta(1, 1, Provenance("spec", "s"))})
    with pytest.raises(ValueError, match="measured none"):
        refresh(launched, spec_only, ("router",))


def test_timing_of_reads_the_calibration_command():
    assert timing_of(load_profile("h100")) is None  # spec sheets
    assert timing_of(load_profile("h100-device-timed")) == "device"
    assert timing_of(load_profile("h100-calibrated")) == "launched"


def test_public_note_cuts_absolute_paths_only():
    assert public_note("--out /root/out/s/p.profile.json --budget-s 200") == \
        "--out p.profile.json --budget-s 200"
    assert public_note("~/x/y.json, ./z.json") == "y.json, z.json"
    for kept in ("1.2 GB/s over 8 ranks", "a/b.json", "see http://x.org/a/b", "50/50"):
        assert public_note(kept) == kept


def test_cli_writes_and_refuses(tmp_path, capsys):
    fit = {"sigmoid_grouped": AlphaBeta(20.0, 1e3, _m())}
    old = _calibrated(OLD + "device", 8.0, fit)
    fresh = _calibrated(NEW + "--timing device", 8.0,
                        {"sigmoid_grouped": AlphaBeta(5.0, 1e3, _m("new"))})
    old.save(tmp_path / "old.json")
    fresh.save(tmp_path / "new.json")
    out = tmp_path / "out.json"
    argv = ["--into", str(tmp_path / "old.json"), "--from", str(tmp_path / "new.json"),
            "--out", str(out)]
    assert main(argv + ["--tables", "router"]) == 0
    assert "took 1 fit(s)" in capsys.readouterr().out
    got = load_profile(str(out)).kernels["router"]["sigmoid_grouped"]
    assert got.alpha_us == 5.0 and json.loads(out.read_text())["name"] == "x"
    assert main(argv + ["--tables", "nope"]) == 2
    assert "no nope fits" in capsys.readouterr().err


def test_calibration_notes_name_files_not_machine_paths():
    from epmoe.bench.calibrate import Clock

    c = Clock(["--out", "/home/me/runs/p.json", "--base", "h100"], 10.0, "GPU")
    assert "--out p.json --base h100" in c.note and "/home" not in c.prov("x").note


def test_refresh_across_gpus_writes_derived_fits_with_the_reason():
    """Another GPU kind's fits only with a reason; they land as derived, saying whose
    measurement they are and why it carries over; the description says derived too."""
    h100 = _calibrated(NEW + "--timing device", 8.0,
                       {"sigmoid_grouped": AlphaBeta(14.0, 2e3, _m("H100, 2026-12-07"), 15.0)})
    base = load_profile("h200")
    h200 = base.replace(name="h200-x", description=OLD + "device", kernels={
        **base.kernels, "router": {"sigmoid_grouped": AlphaBeta(73.0, 1e3, _m(), 112.0)}})
    r = refresh(h200, h100.replace(gpu="h100"), ("router",), across="same SM and clocks")
    fit = r.profile.kernels["router"]["sigmoid_grouped"]
    assert (fit.alpha_us, fit.floor_us) == (14.0, 15.0)  # no host speed on one side: as is
    assert fit.prov.source == "derived"
    assert fit.prov.note.startswith("h100's fit taken for h200 (same SM and clocks): "
                                    "measured: H100, 2026-12-07")
    assert "derived from h100: " in r.profile.description


def test_shipped_profiles_hold_no_machine_paths():
    """Every shipped profile's notes and description as public_note leaves them."""
    from epmoe.plan.profile import profile_document, shipped_profiles

    def texts(d):
        if isinstance(d, dict):
            for k, v in d.items():
                if k in ("note", "description") and isinstance(v, str):
                    yield v
                else:
                    yield from texts(v)
        elif isinstance(d, list):
            for v in d:
                yield from texts(v)

    for name in shipped_profiles():
        found = [t for t in texts(profile_document(name)) if public_note(t) != t]
        assert not found, f"{name}: {found[0][:200]}"
