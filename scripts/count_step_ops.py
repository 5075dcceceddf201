"""How many torch ops (on the GPU: kernels, each a node of the decode step's CUDA graph) one steady
decode step issues, per policy function, on the CPU with the policies' GPU code paths forced in
(Triton kernels under TRITON_INTERPRET=1: tests/gpu_paths.py). A captured step
is launch-bound when it holds thousands of tiny kernels, so this is the inventory to fuse from.

    PYTHONPATH=. python scripts/count_step_ops.py [--modes quest,oasis] [--top 30]

Counts are per decode step and per layer (the tiny model has 2 layers); Triton launches are counted as one op
each under the name of their launcher."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.helpers import write_tiny_config  # noqa: E402
from tests.gpu_paths import force_gpu_kernel_paths  # noqa: E402

SKIP = {"aten.detach.default", "aten.view.default", "aten._unsafe_view.default", "aten.alias.default",
        "aten.unsqueeze.default", "aten.squeeze.dim", "aten.t.default", "aten.expand.default",
        "aten.slice.Tensor", "aten.select.int", "aten.permute.default", "aten.transpose.int",
        "aten.as_strided.default", "aten.lift_fresh.default", "aten.empty.memory_format",
        "aten.empty_like.default", "aten.empty_strided.default", "aten.split.Tensor", "aten.unbind.int",
        "aten.reshape.default", "aten._to_copy.default.cpu", "aten.unfold.default", "aten.movedim.int"}
HOME = os.path.join("oasiskv", "")


def call_site(frame) -> str | None:
    """The innermost oasiskv frame; None inside a Triton launch (the interpreter's own tensor moves)."""
    inner = frame
    while inner is not None:
        if f"triton{os.sep}" in inner.f_code.co_filename:
            return None
        inner = inner.f_back
    while frame is not None:
        path = frame.f_code.co_filename
        if HOME in path and "_python_dispatch" not in path:
            module = path.split(HOME, 1)[1].removesuffix(".py").replace(os.sep, ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_site: Counter = Counter()
        self.by_op: Counter = Counter()
        self.by_pair: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, site = str(func), call_site(sys._getframe(1))
        if name not in SKIP and site is not None and "._check" not in site:  # checks run on the CPU only
            self.by_site[site] += 1
            self.by_op[name] += 1
            self.by_pair[site, name] += 1
        return func(*args, **(kwargs or {}))


def count_triton_launches(counter_of) -> None:
    """Each Triton launch counts as one op, under its caller's name."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter = counter_of()
        if counter is not None:
            frame = sys._getframe(1)
            while f"triton{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            counter.by_site[call_site(frame) or "?"] += 1
            counter.by_op[f"triton.{self.fn.__name__}"] += 1
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="quest,oasis")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--opens", action="store_true", help="count a step in which every draft opens a block")
    p.add_argument("--pairs", action="store_true", help="also list the ops of each policy function")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny model (more: per-layer ops stand out)")
    p.add_argument("--miss-policy", default="skip", choices=("skip", "fetch", "fill"), help="oasis's misses")
    args = p.parse_args()
    torch.set_num_threads(1)
    tiny = write_tiny_config(tempfile.mkdtemp())
    with open(os.path.join(tiny, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(tiny, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": args.layers}, f)
    force_gpu_kernel_paths()
    import oasiskv.models.llama as llama
    from oasiskv.kernels.rms_norm import rms_norm
    llama.rms_norm_reference = rms_norm  # RMSNorm as on CUDA: the kernel (interpreted here), one launch
    active: list = [None]
    count_triton_launches(lambda: active[0])
    with open(os.path.join(tiny, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
    from oasiskv.engine.engine import LLMEngine
    for mode in args.modes.split(","):
        cfg = EngineConfig(model=tiny, load_format="dummy", show_progress=False,
                           kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, fetch_cap=0.5,
                                       host_kv_gb=0.002, miss_policy=args.miss_policy),
                           cache=CacheConfig(kv_cache_gb=0.002),
                           scheduler=SchedulerConfig(max_model_len=1024))
        engine = LLMEngine(cfg)
        g = torch.Generator().manual_seed(0)
        # 300 tokens each: no block opens in the counted step (300 + 3 < 304); with --opens, 301: every
        # request's x_t fills its tail block there, so its draft opens the next one
        prompt_len = 301 if args.opens else 300
        for i in range(3):
            engine.add_request(torch.randint(3, 512, (prompt_len,), generator=g).tolist(),
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id=str(i))
        for _ in range(3):  # prefill, the cold first decode, one steady step
            engine.step()
        counter = active[0] = OpCounter()
        with counter:
            engine.step()
        active[0] = None
        total = sum(counter.by_site.values())
        print(f"== {mode}: {total} ops in one steady decode step of {layers} layers "
              f"({total / layers:.1f} per layer, model and sampling included)")
        for site, n in counter.by_site.most_common(args.top):
            print(f"  {n:5d}  {site}")
        print("  by op:", ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in counter.by_op.most_common(12)))
        if args.pairs:
            for (site, op), n in sorted(counter.by_pair.items()):
                if site.startswith(("policies", "kv", "kernels")):
                    print(f"    {n:5d}  {site}  {op.removeprefix('aten.')}")


if __name__ == "__main__":
    main()
