"""The launcher's failure paths: bad input (exit 2, one line, before any worker; checked up
front: flags, files, backends this machine cannot run), a rank killed from outside with
`kill -9` (exit 3 naming it, nothing left behind), a rank failing at --ep 1 (one line, exit 3),
and a cluster too small for the ranks asked for. The fault matrix is in test_launch_faults.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import time

import pytest
import torch

from epmoe.launch.cli import main
from tests.launch_util import (cmdline, describe, new_tag, ray_nodes, run_launch, tagged_procs,
                               wait_gone)


# ---------------------------------------------------------------------------------- bad flags

BAD_FLAGS = [
    (["--ep", "3"], r"experts \(16\) must be divisible by ep \(3\); choose an ep that divides it"),
    (["--ep", "3", "--eplb", "--redundant-experts", "4"],
     r"physical expert slots \(16 experts \+ 4 redundant = 20\) must be divisible by ep \(3\), "
     r"each rank holding the same number; choose --redundant-experts so that 16 \+ R is a "
     r"multiple of 3"),
    (["--tp", "3"], r"moe intermediate \(128\) must be divisible by tp \(3\)"),
    (["--tp", "4", "--quant", "fp8_block"], r"moe intermediate per partition \(32\) must be a "
                                            r"multiple of fp8_block's quant group \(128\); lower "
                                            r"tp or pick recipe bf16"),
    (["--ep", "2", "--tp", "2"], r"--ep 2 with --tp 2: one parallel form per run"),
    (["--model", "nope-7b"], r"unknown preset 'nope-7b'; choose one of: .*deepseek-v3-tiny"),
    (["--quant", "int3"], r"--quant 'int3' is not a recipe; choose one of bf16, fp8_block"),
    (["--redundant-experts", "4"], r"--redundant-experts needs --eplb"),
    # these were ignored without the flag they mean something beside
    (["--rebalance-every", "3"], r"--rebalance-every needs --eplb \(without it nothing "
                                 r"rebalances\)"),
    (["--eplb-window", "4", "--eplb-migration", "async"],
     r"--eplb-window, --eplb-migration need --eplb"),
    (["--ep", "2", "--backend", "all2all", "--ll-max-tokens", "64"],
     r"--ll-max-tokens chooses between DeepEP's modes for --backend auto; --backend all2all "
     r"is fixed"),
    (["--tp", "2", "--eplb"], r"--eplb places experts across EP ranks: use --ep, not --tp"),
    (["--ep", "0"], r"--ep \(0\) and --tp \(1\) must be >= 1"),
    (["--timeout", "0"], r"--timeout \(0.0\) must be a finite number of seconds > 0"),
    (["--timeout", "nan"], r"--timeout \(nan\) must be a finite number of seconds > 0"),
    (["--start-timeout", "-1"],
     r"--start-timeout \(-1.0\) must be a finite number of seconds > 0"),
    (["--timeout", "inf"], r"--timeout \(inf\) must be a finite number of seconds > 0"),
    (["--seed", str(10**30)], r"--seed \(1000000000000000000000000000000\) must be in "
                              r"\[0, 2\*\*32\)"),
    (["--seed", "-1"], r"--seed \(-1\) must be in \[0, 2\*\*32\)"),
    (["--eplb", "--eplb-window", "0"], r"--eplb-window \(0\) must be >= 1 step"),
    (["--ep", "2", "--backend", "deepep-ll"], r"backend 'deepep-ll' cannot run here"),
    (["--ep", "2", "--backend", "deepep-ht"], r"backend 'deepep-ht' cannot run here"),
    (["--experts", "deepgemm"], r"experts backend 'deepgemm' cannot run here: no CUDA"),
    (["--experts", "torch", "--quant", "fp8_block", "--scale-fmt", "ue8m0_packed"],
     r"experts backend 'torch' cannot run here: its plain-torch row permute cannot reorder "
     r"packed UE8M0 scales"),
    (["--device", "cuda"], r"--device cuda, but this machine has no CUDA device"),
    (["--out", "/nonexistent/dir/x.json"], r"--out /nonexistent/dir/x.json: folder "
                                           r"'/nonexistent/dir' does not exist"),
    (["--out", "/"], r"--out / is a folder; give a file name"),
    (["--plot", "/proc/version"], r"--plot /proc/version is a file; give a folder"),
    (["--eplb", "--rebalance-every", "0"], r"--rebalance-every \(0\) must be >= 1"),
    (["--backend", "allgather"], r"--backend allgather moves tokens between ranks, which form "
                                 r"ep_dp on 1 rank\(s\) does not do"),
    (["--ep", "2", "--no-dp", "--backend", "all2all"], r"--backend all2all moves tokens between "
                                                       r"ranks, which form ep on 2 rank"),
    (["--routing", "zipf"], r"routing spec 'zipf'"),
    (["--quant", "bf16", "--scale-fmt", "ue8m0_packed"], r"scale_fmt \('ue8m0_packed'\) applies "
                                                         r"to fp8_block only"),
    (["--ranks-per-gpu", "0"], r"--ranks-per-gpu \(0\) must be >= 1"),
    (["--ep", "2", "--ranks-per-gpu", "2", "--backend", "all2all"],
     r"--ranks-per-gpu 2 runs --ep > 1 with --backend symm-ht or symm-ll \(NCCL refuses two "
     r"ranks on one GPU"),
    (["--ranks-per-gpu", "2", "--backend", "symm-ht"], r"this run has form ep_dp, 1 rank"),
    (["--ep", "2", "--ranks-per-gpu", "2", "--backend", "symm-ll", "--device", "cpu"],
     r"with --device cpu every rank is a CPU process already"),
    (["--ep", "2", "--ranks-per-gpu", "2", "--backend", "symm-ht", "--eplb"],
     r"--eplb with --ranks-per-gpu > 1 is not supported"),
    (["--ep", "2", "--ranks-per-gpu", "2", "--plan", "auto"],
     r"--ranks-per-gpu 2 with --plan auto: ranks sharing a GPU run one named backend"),
    (["--ep", "2", "--ranks-per-gpu", "2", "--backend", "symm-ht"],
     r"backend 'symm-ht' cannot run here"),
    (["--cuda-graph", "--device", "cpu"], r"--cuda-graph captures CUDA work; drop it with "
                                          r"--device cpu"),
    (["--cuda-graph"], r"--cuda-graph captures CUDA work, but the ranks run on cpu"),
    (["--cuda-graph", "--experts", "torch"], r"layer 0: experts backend torch waits on the host "
                                             r"inside the step \(a loop over experts\)"),
    (["--cuda-graph", "--ep", "2", "--backend", "all2all"],
     r"comm backend all2all waits on the host inside the step \(its counts\); --cuda-graph "
     r"needs one of local, symm-ht, symm-ll"),
    (["--cuda-graph", "--ep", "2", "--no-dp"], r"form ep runs collectives inside the step"),
    (["--cuda-graph", "--ep", "2", "--plan", "auto"],
     r"--cuda-graph captures CUDA work, but the ranks run on cpu \(this machine has no CUDA"),
    (["--cuda-graph", "--steps", "1"], r"--cuda-graph replays steps 1\.\.; with --steps 1 no "
                                       r"step would be replayed"),
    (["--ep", "2", "--comm-option", "ll_dedupe=1"],
     r"comm option 'll_dedupe=1': expected KNOB=VALUE with KNOB one of num_sms, .*ll_dedup"),
    (["--ep", "2", "--comm-option", "num_sms=many"],
     r"comm option 'num_sms=many': num_sms takes a value of type int"),
    (["--ep", "2", "--comm-option", "chunk_cols=3"],
     r"comm options chunk_cols=3: chunk_cols \(3\) must be 0 \(the default\) or a power of two"),
    (["--ep", "2", "--backend", "all2all", "--comm-option", "ll_dedup=1"],
     r"--comm-option tunes symm-ht / symm-ll \(SymmOptions\); --backend all2all takes none"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_exit_2_before_any_worker(flags, message, capsys, monkeypatch):
    if ("--device" in flags or "ranks run on cpu" in message) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if re.search(r"backend '(deepep|symm)-|backend 'deepgemm'", message) and \
            torch.cuda.is_available():
        pytest.skip("a backend this CUDA machine may run: checked by the ranks")
    import epmoe.launch.driver as driver

    def no_driver(*a, **k):
        raise AssertionError("a driver was created for invalid flags")

    monkeypatch.setattr(driver, "driver_for", no_driver)
    t0 = time.monotonic()
    rc = main([*flags, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert time.monotonic() - t0 < 5


def test_ranks_sharing_a_gpu_take_a_fraction_of_it_over_gloo():
    from epmoe.launch.driver import rank_resources

    assert rank_resources(True) == ({"GPU": 1, "CPU": 1}, "nccl")
    assert rank_resources(True, 4) == ({"GPU": 0.25, "CPU": 1}, "gloo")
    assert rank_resources(False, 2) == ({"CPU": 1}, "gloo")


def test_unknown_choice_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--backend", "carrier-pigeon"])
    assert e.value.code == 2
    assert "invalid choice: 'carrier-pigeon'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bad_flags_as_a_process():
    tag = new_tag()
    rc, out, err, wall, seen = run_launch(["--ep", "3"], tag, timeout=100)
    assert rc == 2 and err.strip() == ("error: experts (16) must be divisible by ep (3); choose "
                                       "an ep that divides it (or add redundant experts)"), err
    assert not seen and not tagged_procs(tag)


def test_bad_fault_spec_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("EPMOE_FAULT", "1:step")
    assert main(["--quiet"]) == 2
    assert re.search(r"EPMOE_FAULT \('1:step'\) must be RANK:WHERE:KIND", capsys.readouterr().err)
    monkeypatch.setenv("EPMOE_FAULT", "3:step:exit")
    assert main(["--ep", "2", "--quiet"]) == 2
    assert "EPMOE_FAULT names rank 3, but the run has 2 rank(s)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- traces


def _trace_cases(tmp_path):
    """(file, expected message) for traces that must be refused up front."""
    from epmoe.eplb.routing import save_trace

    good = torch.stack([torch.randperm(16)[:4] for _ in range(3 * 2 * 8)]).view(3, 2, 8, 4)
    cases = []
    (tmp_path / "empty.pt").write_bytes(b"")
    cases.append(("empty.pt", r"cannot be read \("))
    (tmp_path / "corrupt.pt").write_bytes(os.urandom(200))
    cases.append(("corrupt.pt", r"cannot be read \("))
    # a pickle string that is not UTF-8: torch.load raises UnicodeDecodeError, a ValueError
    # (random bytes hit it now and then: the flake this case pins down)
    (tmp_path / "notutf8.pt").write_bytes(b"U\x02\xbb\xbb." + bytes(64))
    cases.append(("notutf8.pt", r"cannot be read \(UnicodeDecodeError"))
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    cases.append(("corrupt.safetensors", r"cannot be read \("))
    with open(tmp_path / "pickled.pt", "wb") as f:  # a pickle of a non-tensor object
        pickle.dump({"topk_ids": re.compile("x")}, f)
    cases.append(("pickled.pt", r"cannot be read \(UnpicklingError: not a torch.save file of "
                                r"tensors\); write it with"))  # not torch's weights_only advice
    torch.save({"ids": good}, tmp_path / "nokey.pt")
    cases.append(("nokey.pt", r"must hold a tensor named 'topk_ids'"))
    save_trace(tmp_path / "probe_shape.pt", good[:, :1, :2])  # the old fixed probe's shape
    cases.append(("probe_shape.pt", r"has \(layers, tokens, top_k\) = \(1, 2, 4\) over 3 "
                                    r"step\(s\), but this run needs \(2, 8, 4\) \(2 layers, "
                                    r"8 tokens = 8 per rank x 1 ranks, top_k 4 of "
                                    r"deepseek-v3-tiny\)"))
    bad = good.clone()
    bad[0, 0, 0, 0] = 16
    save_trace(tmp_path / "range.pt", bad)
    cases.append(("range.pt", r"expert ids span \[0, 16\] but deepseek-v3-tiny has 16 experts"))
    dup = good.clone()
    dup[1, 1, 1, 1] = dup[1, 1, 1, 0]
    save_trace(tmp_path / "dup.pt", dup)
    cases.append(("dup.pt", r"a token lists the same expert twice"))
    cases.append(("missing.pt", r"does not exist"))
    return cases


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_bad_trace_files_exit_2_up_front(tmp_path, capsys, monkeypatch):
    import epmoe.launch.driver as driver

    monkeypatch.setattr(driver, "driver_for", lambda *a, **k: 1 / 0)
    for name, message in _trace_cases(tmp_path):
        rc = main(["--routing", f"trace:{tmp_path / name}", "--tokens", "8", "--layers", "2",
                   "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1, (name, err)
        assert re.search(message, err), (name, err)


# ---------------------------------------------------------------------------------- one rank


def test_errors_at_ep1_are_one_line_exit_3(capsys, monkeypatch, tmp_path):
    from epmoe.runtime import Runtime

    def boom(self, step):
        raise RuntimeError("boom in the experts")

    monkeypatch.setattr(Runtime, "step", boom)
    out = tmp_path / "f.json"
    rc = main(["--tokens", "4", "--layers", "1", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 3 and err == "error: rank 0 failed in step 0: RuntimeError: boom in the experts\n"
    assert json.loads(out.read_text())["failure"]["ranks"] == [0]

    def bad_init(self, *a, **k):
        raise ValueError("cannot build")

    monkeypatch.setattr(Runtime, "__init__", bad_init)
    rc = main(["--tokens", "4", "--layers", "1", "--quiet"])
    assert rc == 3 and capsys.readouterr().err == ("error: rank 0 failed in build: ValueError: "
                                                   "cannot build\n")


# ---------------------------------------------------------------------------------- small cluster


@pytest.fixture(scope="module")
def small_cluster():
    """A 2-CPU Ray head of our own (joined with --address)."""
    with ray_nodes(num_cpus=2) as nodes:
        yield nodes


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_more_ranks_than_the_cluster_has_exit_2(small_cluster, capsys, monkeypatch):
    import ray
    import ray.util.placement_group  # noqa: F401  (the module; ray.util re-exports a function)

    for k, v in small_cluster.auth.items():
        monkeypatch.setenv(k, v)
    pg = sys.modules["ray.util.placement_group"]
    created = []
    monkeypatch.setattr(pg, "placement_group", lambda *a, **k: created.append(a) or 1 / 0)
    import epmoe.launch.driver as driver

    monkeypatch.setattr(driver.RayDriver, "_all", lambda *a, **k: created.append(a) or 1 / 0)
    t0 = time.monotonic()
    rc = main(["--ep", "4", "--address", small_cluster.address, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == ("error: the cluster has 2 CPU, but 4 ranks need 4 (1 each): lower --ep/--tp "
                   "or add nodes\n"), err
    assert not created, "a placement group or actor was requested"
    assert not ray.is_initialized(), "the driver stayed connected to a cluster it only joined"
    assert time.monotonic() - t0 < 60


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_from_outside_exit_3_names_the_killed_rank(small_cluster, tmp_path):
    """A rank's process killed with `kill -9` by someone else while its peer is stuck in step 0:
    the dead rank is blamed (with its pid), the stuck one is named as waiting or stopped."""
    killed = []
    mark = tmp_path / "fault.mark"

    def watch(tag):
        """Once rank 0 hangs in its experts (it writes the mark: then both ranks are inside
        step 0, rank 1 waiting on it), kill the other rank's actor process. Process titles
        do not say which call a rank is in (heartbeats run beside the step)."""
        if killed or not mark.exists():
            return
        hung = int(mark.read_text().split()[1])
        ranks = [p for p in tagged_procs(tag)
                 if cmdline(p).startswith("ray::Worker") and p != hung]
        if len(ranks) == 1:
            time.sleep(1)
            os.kill(ranks[0], signal.SIGKILL)
            killed.append(ranks[0])

    tag = new_tag()
    out = tmp_path / "f.json"
    rc, _, err, wall, seen = run_launch(
        # --timeout bounds each stage; the kill ends the run long before it. 120 s: on a
        # loaded 2-core box the actors' start (imports) alone has taken over 60 s
        ["--ep", "2", "--tokens", "4", "--steps", "2", "--layers", "1", "--timeout", "120",
         "--address", small_cluster.address, "--out", str(out)], tag, timeout=300,
        auth=small_cluster.auth, watch=watch, EPMOE_FAULT="0:experts:hang",
        EPMOE_FAULT_MARK=str(mark))
    print(f"{wall=:.1f}s {killed=} {err.strip().splitlines()[-1:]}")
    assert rc == 3 and killed, err
    f = json.loads(out.read_text())["failure"]
    assert f["kind"] == "died" and f["stage"] == "step 0", f["message"]
    assert f"its process (pid {killed[0]}) died" in f["detail"], f["message"]
    assert len(f["ranks"]) == 1 and set(f["waiting"]) == {0, 1} - set(f["ranks"]), f
    left = wait_gone(tag, within=15)  # the run's actors; the joined cluster keeps running
    assert not left, f"left behind: {describe(left)}"
    assert tagged_procs(small_cluster.tag), "the joined cluster must keep running"
