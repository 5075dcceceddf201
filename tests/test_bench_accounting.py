"""What the throughput bench books: each step's time to the step that ran (async scheduling), the HBM bytes a decode
step reads (worked out by hand for the tiny model), the profiler's kernel time, and the runs --compare-to joins.
Found by a helper's audit of the bench's physics."""
from __future__ import annotations

import json

import pytest

from oasiskv.bench.workload import StepKind, StepLog, book_step, decode_weight_bytes, kv_bytes_read
from oasiskv.cli import main
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from tests.helpers import write_tiny_config
from tests.test_bench_throughput import BLOCK_BYTES, WEIGHTS, bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PER_TOKEN = BLOCK_BYTES // 16  # all layers' K and V of one token (2 layers)
PER_LAYER = PER_TOKEN // 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


def test_async_steps_book_the_time_of_the_step_they_waited_for():
    """With async scheduling a step() call launches step k and waits for step k-1: its time was booked to step k, so
    the last prefill's time went to the first pure decode step (and into decode_step_ms and the graph replays)."""
    prefill, decode = StepKind(0, 128, 0, False), StepKind(4, 0, 1000, True)
    log, flight = StepLog(), None
    calls = [(0.001, prefill, True), (3.0, decode, True), (0.3, decode, True), (0.3, StepKind(0, 0, 0, False), False)]
    for dt, launched, overlapped in calls:  # launch the prefill; wait for it; wait for decode 1; wait for decode 2
        flight = book_step(log, dt, launched, flight, overlapped)
    assert flight is None
    assert (log.prefill_steps, log.prefill_time_s) == (1, 3.0)
    assert (log.decode_steps, log.decode_tokens, log.hbm_bytes) == (2, 8, 2000)
    assert log.decode_time_s == pytest.approx(0.6) and log.replay_time_s == pytest.approx(0.6)
    sync = StepLog()  # a synchronous engine: each call's time is its own step's
    book_step(sync, 0.5, decode, None, overlapped=False)
    assert (sync.decode_steps, sync.decode_time_s) == (1, 0.5)


@pytest.mark.parametrize("flags, per_layer_tokens", [
    ({}, [64 + 17, 64 + 17]),  # the budget and one summary per block (17 blocks of 260 tokens)
    ({"summary_tokens": 4}, [64 + 68, 64 + 68]),  # a summary per 4 tokens
    ({"dense_layers": 1}, [260, 64 + 17]),  # the first layer reads every token
    ({"shortlist": 2.0}, [64 + 17 + 64, 64 + 17 + 64]),  # the 128 listed tokens' keys again: 64 tokens' K and V
])
def test_a_sparse_decode_step_reads_the_bytes_worked_out_by_hand(tiny, flags, per_layer_tokens):
    """--summary-tokens, --dense-layers and --shortlist read more than the budget and one summary per block, which
    was all that was counted."""
    engine = LLMEngine(EngineConfig(model=tiny, load_format="dummy", show_progress=False,
                                    kv=KVConfig(mode="quest", budget=64, sink_blocks=1, local_blocks=1, **flags),
                                    cache=CacheConfig(kv_cache_gb=0.002), scheduler=SchedulerConfig(max_model_len=1024)))
    assert engine.kv_bytes_per_token == PER_TOKEN
    assert kv_bytes_read(engine, 260) == sum(per_layer_tokens) * PER_LAYER
    assert kv_bytes_read(engine, 50) == 50 * PER_TOKEN  # within the budget every layer attends densely


def test_an_untied_embedding_table_is_not_read_whole(tmp_path):
    """A decode step gathers its tokens' rows of the embedding table; the roofline counted the whole table."""
    write_tiny_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", show_progress=False,
                                    cache=CacheConfig(kv_cache_gb=0.002)))
    embedding = 512 * 64 * 4
    assert engine.weights_bytes() == WEIGHTS + embedding  # the output head besides the table
    assert decode_weight_bytes(engine) == WEIGHTS


def test_the_profilers_kernel_time_counts_each_kernel_once():
    """A CPU op's row carries its kernels' time as well: summing every row counted each kernel twice."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from oasiskv.bench.step_profile import device_busy_us

    op = FunctionEvent(id=1, name="aten::mm", thread=0, start_us=0, end_us=10, device_type=DeviceType.CPU,
                       use_device="cuda", stack=[])
    kernel = FunctionEvent(id=2, name="gemm", thread=0, start_us=5, end_us=105, device_type=DeviceType.CUDA,
                           use_device="cuda", stack=[])
    op.append_kernel(kernel.name, 0, 100)  # what the profiler does for a kernel the op launched
    events = EventList([op, kernel], use_device="cuda")
    events._build_tree()
    assert device_busy_us(events.key_averages()) == 100


@pytest.mark.parametrize("change, said", [
    (lambda r: r.update(device="NVIDIA H100 80GB HBM3"), "device 'NVIDIA H100 80GB HBM3' there, 'cpu' here"),
    (lambda r: r["workload"].update(prompt_seed=7), "prompt_seed 7 there, 0 here")])
def test_compare_to_refuses_a_run_on_other_hardware_or_prompts(tiny, tmp_path, change, said):
    first = tmp_path / "first.json"
    bench(tiny, "--modes", "dense", "--max-num-seqs", "2", "--json", str(first))
    run = json.loads(first.read_text())
    change(run)
    first.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match=f"--compare-to .* measured another run \\({said}"):
        main(["bench", "throughput", "--model", tiny, "--load-format", "dummy", "--input-len", "128", "--output-len",
              "4", "--modes", "quest", "--compare-to", str(first), "--json", str(tmp_path / "b.json")])


def test_modes_under_tensor_parallelism_count_every_gpus_bytes_against_every_gpus_bandwidth(tiny, tmp_path):
    """Under -tp 2 --modes counted rank 0's weights with every KV head's bytes, over one GPU's bandwidth (single-mode
    runs counted both ranks): the same step's bytes now whatever the ranks, over the ranks' bandwidth."""
    rows = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        bench(tiny, "--modes", "dense", "--max-num-seqs", "2", "--num-prompts", "2", "--hbm-gbps", "10", "-tp", str(tp),
              "--json", str(out))
        rows[tp] = json.loads(out.read_text())["rows"][0]
    # (each rank also reads its copy of the replicated norm weights: 1.3 KB more under -tp 2)
    assert rows[2]["hbm_gb_per_step"] * 1e9 == pytest.approx(rows[1]["hbm_gb_per_step"] * 1e9 + 5 * 64 * 4, rel=1e-3)
    assert rows[1]["hbm_gb_per_step"] * 1e9 == pytest.approx(WEIGHTS + 2 * (128 + 2) * PER_TOKEN, rel=0.02)
    assert (rows[1]["hbm_gbps"], rows[2]["hbm_gbps"]) == (10, 20)
