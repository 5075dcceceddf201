"""`oasiskv bench kernels` and `oasiskv bench hf-reference` at tiny sizes on the CPU (torch references; the
GPU runs the Triton kernels through the same code)."""
from __future__ import annotations

import json

import pytest
import torch

from oasiskv.bench.kernels import selection_case
from oasiskv.cli import main
from tests.helpers import write_tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_selection_case_picks_sink_local_window_and_distinct_blocks():
    shapes = {"q_heads": 4, "kv_heads": 2, "head_dim": 16}
    cases, n_sel = selection_case(3, 500, 160, shapes, torch.float32, torch.device("cpu"), seed=0, rotations=2)
    nb = -(-500 // 16)
    assert n_sel == 10 and len(cases) == 2
    for q, kv, tables, indptr, indices, seq_lens, scale in cases:
        assert indptr.tolist() == [0, 10, 20, 30] and q.shape == (3, 4, 16)
        for b in range(3):
            sel = indices[indptr[b]:indptr[b + 1]].tolist()
            assert sel == sorted(set(sel)) and sel[0] == 0 and sel[-8:] == list(range(nb - 8, nb))
            assert all(0 <= tables[b, j] < kv.shape[0] for j in sel)


def test_bench_kernels_runs_the_references(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    main(["bench", "kernels", "--device", "cpu", "--context", "512", "--batches", "1,2", "--budget", "160",
          "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "3", "--host-gib", "0.001",
          "--chunks", "16", "--json", str(out)])
    r = json.loads(out.read_text())
    g = r["gather"]
    assert g["correct"] and g["bytes"] == 16 * 2 * 16 * 2 * 16 * 4 and g["gather_gbps"] > 0
    assert g["ratio_to_contiguous"] == pytest.approx(g["gather_gbps"] / g["contiguous_h2d_gbps"], rel=1e-2)
    assert r["memory_copy_gbps"] > 0
    assert [a["batch"] for a in r["sparse_attention"]] == [1, 2]
    for a in r["sparse_attention"]:
        assert a["selected_blocks"] == 10 and a["correct"] and a["eager_gbps"] > 0
        assert a["bytes"] == a["batch"] * (10 * 16 * 2 * 2 * 16 * 4 + 2 * 4 * 16 * 4)  # K/V read, q and out
    for s in r["scoring"]:
        assert s["blocks"] == 32
        assert s["score_select_ms_per_step"] == pytest.approx(3 * s["score_select_us_per_layer"] / 1000, rel=1e-2)
        assert s["mass_select_ms_per_step"] == pytest.approx(3 * s["mass_select_us_per_layer"] / 1000, rel=1e-2)
        assert s["summary_mb"] == pytest.approx(s["batch"] * 32 * 2 * 2 * 16 * 4 / 1e6, rel=1e-3)  # fp32 min, max
    assert [(s["batch"], s["keys"]) for s in r["shortlist"]] == [(1, "float32"), (1, "fp8"), (2, "float32"),
                                                                 (2, "fp8")]
    for s in r["shortlist"]:  # a list of 2 x the budget's 10 blocks; keys in fp32, or e4m3 with an fp32 scale a
        # token (the CPU runs the twin: the kernel against it and a brute force is tests/test_kernel_shortlist_mass.py)
        assert s["listed_blocks"] == 20 and s["us"] > 0
        token_bytes = 16 * 4 if s["keys"] == "float32" else 16 + 4
        assert s["key_mb"] == pytest.approx(s["batch"] * 20 * 16 * 2 * token_bytes / 1e6, rel=1e-3)
    printed = capsys.readouterr().out
    assert "sparse decode attention" in printed and "shortlist pass" in printed


def test_hf_reference_generates_the_workload(tmp_path):
    model = write_tiny_config(tmp_path / "tiny", "qwen3")
    out = tmp_path / "hf.json"
    main(["bench", "hf-reference", "--model", str(model), "--device", "cpu", "--input-len", "48", "--output-len", "4",
          "--batch", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    row = r["rows"][0]
    assert r["kind"] == "hf_reference" and row["batch"] == 2 and row["output_len"] == 4
    assert row["output_tok_s"] == pytest.approx(2 * 4 / row["elapsed_s"], rel=1e-2)
    assert row["total_tok_s"] == pytest.approx(2 * (48 + 4) / row["elapsed_s"], rel=1e-2)
    assert row["decode_tok_s"] > 0 and row["mean_tpot_ms"] > 0


def test_hf_reference_needs_a_batch_on_the_cpu(tmp_path):
    with pytest.raises(SystemExit, match="give --batch on the CPU"):
        main(["bench", "hf-reference", "--model", "qwen3-0.6b", "--device", "cpu"])


def test_hf_reference_refuses_weights_that_do_not_fit(tmp_path, monkeypatch):
    """The weights' bytes (parameters counted on the meta device) against the free memory, before any allocation:
    on the CPU the kernel would kill the process without a word."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from oasiskv.models.loader import read_hf_config, resolve_source

    model = write_tiny_config(tmp_path / "tiny", "qwen3")
    cfg = AutoConfig.for_model(**read_hf_config(*resolve_source(str(model))))
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) * 4  # fp32
    args = ["bench", "hf-reference", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--input-len",
            "48", "--output-len", "4", "--batch", "1", "--json", str(tmp_path / "hf.json")]
    monkeypatch.setattr("oasiskv.bench.hf_reference.spare_host_bytes", lambda reserve_gb: weights - 1)
    with pytest.raises(SystemExit, match=r"weights take .* GiB in float32; this cpu has .* free"):
        main(args)
    monkeypatch.setattr("oasiskv.bench.hf_reference.spare_host_bytes", lambda reserve_gb: weights)
    main(args)  # exactly enough
