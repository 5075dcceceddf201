"""The engine's GPU kernel paths, run on the CPU: oasis on a tiny random model with every Triton kernel the
policies use on CUDA forced in (under TRITON_INTERPRET=1) gives the torch path's tokens and counters.

Unit tests of each kernel feed it well-formed tensors; this drives them with what the engine really passes
(views, one-request batches, per-row layer lists). It caught a stride-0 row list that the prediction and
placement kernels read past its end with a single request (an illegal address on the H200); under the
interpreter an out-of-bounds access is a segfault, so the forced run is run in a subprocess."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import write_tiny_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTERS = ("kv_selected_blocks", "kv_hits", "kv_misses", "kv_prefetched_blocks", "kv_fetched_blocks",
            "kv_agree_hits", "kv_agree_total", "kv_max_prefetched_blocks", "kv_filled_blocks")

RUN = textwrap.dedent('''
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.triton_compat import squeeze_interpreted_indices
    squeeze_interpreted_indices()
    import torch
    torch.set_num_threads(1)
    from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
    from oasiskv.engine.engine import LLMEngine
    tiny, lengths, forced = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3] == "1"
    block_score, miss_policy, select_per = sys.argv[4], sys.argv[5], sys.argv[6]
    summary_tokens = int(sys.argv[7]) or None
    layer_weights = tuple((int(l), float(w)) for l, w in (p.split("=") for p in sys.argv[8].split(",") if p))
    shortlist = float(sys.argv[9])
    if forced:  # what the policies call on CUDA, in place of the torch twins they call on the CPU
        from tests.gpu_paths import force_gpu_kernel_paths
        force_gpu_kernel_paths()
    cfg = EngineConfig(model=tiny, load_format="dummy", show_progress=False,
                       kv=KVConfig(mode="oasis", budget=64, sink_blocks=1, local_blocks=1, fetch_cap=0.5,
                                   host_kv_gb=0.002, block_score=block_score, miss_policy=miss_policy,
                                   select_per=select_per, summary_tokens=summary_tokens,
                                   layer_weights=layer_weights, shortlist=shortlist),
                       cache=CacheConfig(kv_cache_gb=0.002), scheduler=SchedulerConfig(max_model_len=1024))
    engine = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lengths):
        engine.add_request(torch.randint(3, 512, (n,), generator=g).tolist(),
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id=str(i))
    while engine.has_unfinished():
        engine.step()
    print(json.dumps({"tokens": [engine.requests[str(i)].output_token_ids for i in range(len(lengths))],
                      "stats": engine.stats_dict()}))
''')


def generate(tiny: str, lengths: str, forced: bool, block_score: str, miss_policy: str, select_per: str,
             summary_tokens: int, layer_weights: str, shortlist: float) -> dict:
    # CUDA hidden: on a GPU machine the engine would otherwise run on the device, its kernels interpreted there
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", RUN, tiny, lengths, "1" if forced else "0", block_score,
                           miss_policy, select_per, str(summary_tokens), layer_weights, str(shortlist)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"exit {done.returncode} (-11: segfault, an out-of-bounds access)\n"
                                  f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
# layer weights 1=2: layer 0 selects 2 blocks and layer 1 5 (128 tokens over 2 layers at a weight of 3), so the
# prediction group of both layers is planned in two launches
# shortlist 2: the second pass over 8 listed blocks of a 4-block budget, in a working set of 9; x_t then picks among
# the listed blocks it holds, so it misses none here (the cold requests' lists are fetched first)
@pytest.mark.parametrize("lengths, block_score, miss_policy, select_per, summary_tokens, layer_weights, shortlist", [
    ("300", "bound", "skip", "layer", 0, "", 0), ("300,90,200", "bound", "skip", "layer", 0, "", 0),
    ("300,90,200", "bound", "fill", "layer", 0, "1=2", 0), ("300,90,200", "mass", "skip", "kv-head", 4, "", 0),
    ("300,90,200", "bound", "skip", "layer", 0, "", 2)],
    ids=["one_request", "three_requests", "three_requests_fill_layer_weights",
         "three_requests_mass_per_kv_head_4_token_summaries", "three_requests_shortlist"])
def test_every_gpu_kernel_in_the_engine_gives_the_torch_tokens_and_counters(tmp_path, lengths, block_score,
                                                                          miss_policy, select_per, summary_tokens,
                                                                          layer_weights, shortlist):
    tiny = write_tiny_config(tmp_path / "tiny")
    run = dict(block_score=block_score, miss_policy=miss_policy, select_per=select_per, summary_tokens=summary_tokens,
               layer_weights=layer_weights, shortlist=shortlist)
    torch_path = generate(tiny, lengths, forced=False, **run)
    kernels = generate(tiny, lengths, forced=True, **run)
    assert kernels["tokens"] == torch_path["tokens"]
    assert {k: kernels["stats"][k] for k in COUNTERS} == {k: torch_path["stats"][k] for k in COUNTERS}
    assert torch_path["stats"]["kv_prefetched_blocks"] > 0 and torch_path["stats"]["kv_cold_fetched_blocks"] > 0
    assert torch_path["stats"]["kv_misses"] > 0 or shortlist
    assert (torch_path["stats"]["kv_filled_blocks"] > 0) == (miss_policy == "fill")
