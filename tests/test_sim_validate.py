"""The simulator against DeepEP's published H800 tables (predicted from the spec profile)."""

import json

from epmoe.sim.__main__ import main
from epmoe.sim.validate import PUBLISHED, predict, table, validate


def test_deepep_ep8_rows_within_20_percent():
    rows = [r for r in PUBLISHED if r.ep == 8]
    assert {(r.mode, r.direction) for r in rows} == {("ht", "dispatch"), ("ht", "combine"),
                                                     ("ll", "dispatch"), ("ll", "combine")}
    for r in rows:
        res = predict(r)
        assert abs(res.error) < 0.20, (r.name, res.predicted, r.published)


def test_every_row_is_predicted_and_printed(capsys):
    res = validate()
    assert len(res) == len(PUBLISHED)
    assert all(r.predicted > 0 and r.kernel_us > 0 for r in res)
    # intranode rows are NVLink-bound; internode LL rows RDMA-bound
    assert {r.link for r in res if r.row.ep == 8} == {"nvlink"}
    assert {r.link for r in res if r.row.ep > 8 and r.row.mode == "ll"} == {"rdma"}
    assert all(len(line) <= 80 for line in table(res).splitlines())
    assert main(["validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc) == len(PUBLISHED) and {"error", "predicted", "published"} <= set(doc[0])
