"""The report of a program pipelined over four IPUs: every IPU named with
its own fullest tile in the JSON, the text and the page; memory by
category; liveness per IPU; folded rows with counts; the stage map's op
counts; the program text."""
import json
import re

import numpy as np
import pytest
from four_ipu_model import compile_four_ipus

from poptorchsim.__main__ import main
from poptorchsim.profiling import load_reports, summary
from poptorchsim.profiling.sections import fold, table
from poptorchsim.profiling.text import fmt_bytes


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """(training model, its report as written to profile.json, report dir)."""
    root = tmp_path_factory.mktemp("four_ipus")
    training = compile_four_ipus(root)
    (report,) = load_reports(str(root))
    return training, report, root / "training"


def test_json_has_every_ipu_with_its_own_fullest_tile(four):
    training, report, _ = four
    ipus = report["ipus"]
    assert [r["ipu"] for r in ipus] == [0, 1, 2, 3]
    compiled = training.memoryReport().ipus
    for r, m in zip(ipus, compiled):
        total = np.asarray(r["total"])
        assert np.array_equal(total, m.total)                       # the IPU's own arrays
        assert r["peak_bytes"] == total.max() == total[r["peak_tile"]]
        assert r["total_bytes"] == total.sum()
        assert r["fits"] == (total.max() <= r["capacity"])
    # the blocks differ in width: IPU 1 (48 x 160 weights) is not IPU 0 (16 x 48)
    assert ipus[1]["peak_bytes"] != ipus[0]["peak_bytes"]
    assert ipus[1]["total_bytes"] > ipus[0]["total_bytes"]
    worst = max(ipus, key=lambda r: r["peak_bytes"])
    mem = report["memory"]
    assert (mem["peak_ipu"], mem["peak_ipu_bytes"]) == (worst["ipu"], worst["peak_bytes"])
    assert mem["fits"] == all(r["fits"] for r in ipus)
    # the program-wide dtype totals are the sum of each IPU's
    summed = {}
    for r in ipus:
        for d, b in r["always_live_by_dtype"].items():
            summed[d] = summed.get(d, 0) + b
    assert mem["always_live_by_dtype"] == summed


def test_one_ipu_over_capacity_is_the_one_reported(tmp_path, monkeypatch):
    """IPU 1 overflows while IPU 0 fits: the verdict, the text and the page
    say so (they used to describe IPU 0 alone)."""
    monkeypatch.setenv("POPTORCHSIM_SMALL_IPU_MODEL", "1")     # 4 tiles x 624 KiB
    compile_four_ipus(tmp_path, widths=(16, 512, 1024, 32))   # 2 MiB of weights on IPU 1
    (report,) = load_reports(str(tmp_path))
    fits = [r["fits"] for r in report["ipus"]]
    assert fits[0] and not fits[1]
    mem = report["memory"]
    assert not mem["fits"] and mem["peak_ipu"] == 1
    assert mem["tiles_over"] == sum(r["tiles_over"] for r in report["ipus"]) > 0
    text = summary(report)
    worst = report["ipus"][1]
    assert "DOES NOT FIT" in text
    assert f"IPU 1 peak tile {worst['peak_tile']} holds {fmt_bytes(worst['peak_bytes'])}" in text
    html = (tmp_path / "training" / "index.html").read_text()
    sections = dict(re.findall(r"<section class='ipu' id='ipu-(\d)'.*?<p class='(\w+)'>", html,
                               re.S))
    assert sections["0"] == "ok" and sections["1"] == "bad"


def test_memory_by_category_adds_up(four):
    training, report, _ = four
    code = report["target"]["code_bytes_per_tile"]
    for r, m in zip(report["ipus"], training.memoryReport().ipus):
        cats = r["categories"]
        always = sum(np.asarray(cats[k]["per_tile"])
                     for k in ("code", "vertex_state", "variables", "stream_buffers"))
        assert np.array_equal(always, r["always_live"])
        assert cats["not_always_live"]["per_tile"] == r["not_always_live"]
        # the runtime on every tile, and control code where ops run
        assert min(cats["code"]["per_tile"]) >= code
        assert max(cats["code"]["per_tile"]) > code
        assert np.array_equal(np.asarray(cats["code"]["per_tile"]) - code, m.control_code)
        assert cats["vertex_state"]["bytes"] > 0 and cats["vertex_state"]["bytes"] % 48 == 0
        assert cats["variables"]["bytes"] + cats["stream_buffers"]["bytes"] == \
            sum(int(v.sum()) for v in m.by_tensor.values())
        assert not cats["exchange_buffers"]["modelled"]
        peak = r["peak_tile"]
        assert sum(c["peak_tile_bytes"] for c in cats.values() if c["modelled"]) == \
            r["total"][peak]
    # only IPU 0 reads the input batch, only IPU 3 the labels
    streams = [r["categories"]["stream_buffers"]["bytes"] for r in report["ipus"]]
    assert streams[0] > 0 and streams[1] == streams[2] == 0 and streams[3] > 0


def test_liveness_per_ipu(four):
    training, report, _ = four
    graph = training.getIR().graphs["training_step"]
    for r in report["ipus"]:
        live = r["liveness"]["training_step"]
        assert len(live) == len(graph.ops)
        step = r["peak_step"]["training_step"]
        assert live[step["step"]] == max(live) == step["bytes"] > 0
        assert graph.ops[step["step"]].name == step["op"]
        # nothing is live on an IPU before its first op has run
        first = min(k for k, op in enumerate(graph.ops) if op.ipu == r["ipu"])
        assert not any(live[:first])
    summed = np.sum([r["liveness"]["training_step"] for r in report["ipus"]], axis=0)
    assert summed.tolist() == report["liveness"]["training_step"]


def test_text_report_names_every_ipu(four, capsys):
    _, report, root = four
    text = summary(report)
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s+(\d+)\s+(\d+)\s+([\d.]+ \w?i?B)\s+[\d.]+%\s+\S+ \S+\s+(yes|NO)", line)
        if m:
            rows[int(m.group(1))] = (int(m.group(2)), m.group(3))
    assert rows == {r["ipu"]: (r["peak_tile"], fmt_bytes(r["peak_bytes"]))
                    for r in report["ipus"]}
    for r in report["ipus"]:
        assert f"IPU {r['ipu']} peak tile {r['peak_tile']} by category: code " in text
    assert "exchange buffers not modelled" in text
    assert main(["report", str(root)]) == 0          # python -m poptorchsim report DIR
    assert text in capsys.readouterr().out


def test_page_has_a_section_per_ipu(four):
    _, report, root = four
    html = (root / "index.html").read_text()
    sections = re.findall(r"<section class='ipu' id='ipu-(\d)'.*?</section>", html, re.S)
    assert sections == ["0", "1", "2", "3"]
    for r in report["ipus"]:
        body = re.search(rf"<section class='ipu' id='ipu-{r['ipu']}'.*?</section>", html,
                         re.S).group(0)
        assert f"peak tile {r['peak_tile']} holds {fmt_bytes(r['peak_bytes'])}" in body
        assert "not modelled" in body and "<svg class='spark'" in body
        image = "memory.png" if r["ipu"] == 0 else f"memory_ipu{r['ipu']}.png"
        assert image in body and (root / image).is_file()


def test_precision_rows_are_folded_with_counts(four):
    _, report, root = four
    unscale = [op for op in report["ops"] if op["role"] == "gradient unscale"]
    assert len(unscale) == 8                        # a weight and a bias per block
    html = (root / "index.html").read_text()
    rows = re.findall(r"<tr><td>gradient unscale</td><td>.*?</td><td class=\"n\">(\d+)</td>",
                      html)
    keys = {(op["op"], op["dtype"], op["rounding"]) for op in unscale}
    assert len(rows) == len(keys) < len(unscale)
    assert sum(map(int, rows)) == len(unscale)


def test_fold_and_long_tables():
    rows = [("unscale", i) for i in range(100)] + [("scale", 0)]
    groups = fold(rows, key=lambda r: r[0])
    assert [(first[0], n) for first, n, _ in groups] == [("unscale", 100), ("scale", 1)]
    html = table(["a", "b"], [(i, i * i) for i in range(30)], limit=25)
    shown, folded = html.split("<details", 1)
    assert shown.count("<tr>") == 26 and folded.count("<tr>") == 6      # with the headers
    assert "5 more rows (30 in all)" in folded and "class='wrap'" in shown


def test_stage_map_counts_each_blocks_forward_ops(four):
    training, report, _ = four
    program = training.getIR()
    graph = program.graphs["training_step"]
    counted = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"blocks (\w+) \((\d+) forward ops\)", report["pipeline"]["stage_map"])}
    by_block = {}
    for op in graph.ops:
        if not op.backward:
            by_block[op.block[0]] = by_block.get(op.block[0], 0) + 1
    assert counted == by_block
    assert counted["b3"] >= 3            # the matmul, its ReLU and the loss


def test_program_text_on_the_page(four):
    training, report, root = four
    assert report["program_text"] == str(training.getIR())
    html = (root / "index.html").read_text()
    pre = re.search(r"<details class='program'[^>]*><summary>(\d+) lines</summary>"
                    r"<pre class='scroll'>(.*?)</pre>", html, re.S)
    assert int(pre.group(1)) == len(report["program_text"].splitlines())
    assert "repeat 8 (accumulation)" in pre.group(2)
    assert json.dumps(report)            # the whole report stays JSON
