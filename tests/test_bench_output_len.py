"""`python -m oasiskv.bench.output_len`: `bench throughput --modes` runs at several output lengths joined into one
table. Real runs of a tiny random model on the CPU, then the ratios checked by dividing the rows by hand."""
from __future__ import annotations

import json

import pytest

from oasiskv.bench.output_len import join_runs, main as output_len_main
from oasiskv.cli import main
from tests.helpers import write_tiny_config

IN = 128

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs of dense and oasis, at 4 and 8 output tokens."""
    root = tmp_path_factory.mktemp("output_len")
    tiny = write_tiny_config(root)
    paths = []
    for out in (4, 8):
        path = str(root / f"out{out}.json")
        main(["bench", "throughput", "--model", tiny, "--load-format", "dummy", "--input-len", str(IN),
              "--output-len", str(out), "--kv-budget", "64", "--sink-blocks", "1", "--local-blocks", "1",
              "--fetch-cap", "0.5", "--kv-cache-gb", "0.002", "--host-kv-gb", "0.002",
              "--max-num-batched-tokens", "512", "--warmup-steps", "1", "--modes", "dense,oasis", "--json", path])
        paths.append(path)
    return paths


def rows_of(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["rows"]


def test_rows_keep_each_run_and_ratios_divide_by_the_same_lengths_dense(runs, tmp_path):
    joined_path, plot = str(tmp_path / "joined.json"), str(tmp_path / "ratio.png")
    result = output_len_main([*runs, "--json", joined_path, "--plot", plot])
    assert [(r["output_len"], r["mode"]) for r in result["rows"]] == [(4, "dense"), (4, "oasis"), (8, "dense"),
                                                                       (8, "oasis")]
    for length, path in zip((4, 8), runs):
        source = {r["mode"]: r for r in rows_of(path)}
        for row in (r for r in result["rows"] if r["output_len"] == length):
            assert row["output_tok_s"] == source[row["mode"]]["output_tok_s"]
            assert row["from"] == path
            expected = row["output_tok_s"] / source["dense"]["output_tok_s"]
            assert row["output_vs_dense"] == pytest.approx(expected, rel=1e-3)
    with open(joined_path) as f:
        assert json.load(f)["kind"] == "output_len_sweep"
    with open(plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_later_file_replaces_the_same_mode_at_the_same_length(runs, tmp_path):
    with open(runs[0]) as f:
        rerun = json.load(f)
    rerun["rows"] = [dict(r, output_tok_s=2 * r["output_tok_s"]) for r in rerun["rows"] if r["mode"] == "oasis"]
    path = str(tmp_path / "rerun.json")
    with open(path, "w") as f:
        json.dump(rerun, f)
    rows = {(r["output_len"], r["mode"]): r for r in join_runs([runs[0], path])["rows"]}
    first = {r["mode"]: r for r in rows_of(runs[0])}
    assert rows[(4, "oasis")]["from"] == path and rows[(4, "dense")]["from"] == runs[0]
    assert rows[(4, "oasis")]["output_vs_dense"] == pytest.approx(
        2 * first["oasis"]["output_tok_s"] / first["dense"]["output_tok_s"], rel=1e-3)


@pytest.mark.parametrize("change, message", [
    ({"kind": "concurrency_sweep"}, "not a `bench throughput --modes` run"),
    ({"workload": {"input_len": 2 * IN, "output_len": 4}}, "differ in input length"),
])
def test_runs_that_do_not_join_are_refused(runs, tmp_path, change, message):
    with open(runs[0]) as f:
        other = {**json.load(f), **change}
    path = str(tmp_path / "other.json")
    with open(path, "w") as f:
        json.dump(other, f)
    with pytest.raises(SystemExit, match=message):
        join_runs([runs[1], path])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="cannot read .*nothing.json"):
        join_runs([str(tmp_path / "nothing.json")])
