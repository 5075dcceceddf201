"""oasiskv train-draft: trains an EAGLE-3 head for a target (../shared/reference/eagle3.md §5).

1. Data: prompts from the Python standard library (draft_data.py), answered by the target through our
   engine; saved as DIR/data.pt, reused by --resume.
2. Draft vocabulary: the most frequent reply tokens (d2t offsets; t2d written by the saver).
3. Training: the target runs in the loop (online features), the head is unrolled --ttt-length steps
   (ttt.py) with loss weights decay^k; AdamW, warm-up then cosine; checkpoint every N steps.
4. DIR gets config.json + model.safetensors (EAGLE/SpecForge layout), training.json with the settings,
   times and the held-out per-step accuracy.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import signal
import threading
import time

import torch
from tqdm.auto import tqdm

from oasiskv.lookahead import draft_data
from oasiskv.lookahead.draft_data import Conversation
from oasiskv.lookahead.ttt import target_pass, unroll
from oasiskv.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
from oasiskv.models.llama import CausalLM

GPU_GEN_KV_GB = 16.0  # enough for hundreds of 1K-token requests, and leaves the card to training
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target: HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--out", required=True, help="directory for the head, data.pt, checkpoint.pt, training.json")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="target dtype (auto: bf16 on GPU, fp32 on CPU); the head "
                                                   "trains in fp32 under autocast")
    p.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data")
    d.add_argument("--num-conversations", type=int, default=4000, help="prompts answered by the target")
    d.add_argument("--eval-conversations", type=int, default=64, help="held out for the final accuracy")
    d.add_argument("--max-len", type=int, default=1024, help="tokens per conversation, prompt and reply")
    d.add_argument("--max-new-tokens", type=int, default=384, help="reply length cap when regenerating")
    d.add_argument("--temperature", type=float, default=0.8, help="sampling temperature when regenerating")
    d.add_argument("--gen-max-num-seqs", type=int, default=256, help="requests the engine runs at once")
    d.add_argument("--gen-kv-cache-gb", type=float, default=None,
                   help=f"KV cache of the regenerating engine (default: {GPU_GEN_KV_GB:g} on a GPU, "
                        "the engine's on CPU)")
    h = p.add_argument_group("head and training")
    h.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="SmolLM2-135M: 4096 gives a 15.0 MB head in fp16 (the lm_head is 1152 bytes per token)")
    h.add_argument("--ttt-length", type=int, default=7, help="unrolled draft steps")
    h.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of step k is decay^k")
    h.add_argument("--batch-size", type=int, default=16, help="conversations per optimizer step")
    h.add_argument("--epochs", type=float, default=4.0)
    h.add_argument("--steps", type=int, default=None, help="optimizer steps (default: epochs x batches)")
    h.add_argument("--lr", type=float, default=5e-4)
    h.add_argument("--warmup", type=float, default=0.03, help="share of the steps with a linear warm-up")
    h.add_argument("--clip", type=float, default=0.5, help="gradient norm clip")
    h.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    h.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt (and reuse DIR/data.pt)")
    h.add_argument("--save-dtype", default="float16", choices=sorted(SAVE_DTYPES))


def interrupted_message(out: str) -> str:
    """data.pt is written only once every reply exists: an interrupted generation keeps nothing to resume."""
    if not os.path.isfile(os.path.join(out, "data.pt")):
        return "train-draft interrupted while generating its data, which is lost: run it again (without --resume)"
    kept = "data.pt and checkpoint.pt" if os.path.isfile(os.path.join(out, "checkpoint.pt")) else "data.pt"
    return f"train-draft interrupted; {out} keeps {kept}: --resume continues"


@dataclasses.dataclass
class TrainResult:
    head: Eagle3Head
    losses: list[float]
    eval_accuracy: list[float]
    times: dict


def main(args: argparse.Namespace) -> None:
    try:
        result = train(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit(interrupted_message(args.out)) from None
    t = result.times
    if not result.eval_accuracy:
        print("held-out top-1 accuracy: none held out (--eval-conversations 0, or fewer than 4 conversations)")
    else:
        print(f"held-out top-1 accuracy per draft step: {' '.join(f'{a:.3f}' for a in result.eval_accuracy)}")
    print(f"time: data {t['data_s']:.1f} s, training {t['train_s']:.1f} s, total {t['total_s']:.1f} s")
    print(f"head saved to {args.out}")


@contextlib.contextmanager
def interrupts_between_steps():
    """Inside, a first Ctrl-C or SIGTERM (in the main thread) only sets the flag that `asked()` reads, so the loop
    can stop between optimizer steps with a consistent checkpoint; a second one interrupts at once."""
    asked = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield asked.is_set
        return

    def note(signum, frame):  # (no print here: a signal during another write to stdout would make it reentrant)
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked.is_set
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# each numeric flag's rule and its wording, checked before the target loads (data generation takes minutes)
ARG_RULES = {
    "num_conversations": (lambda v: v >= 1, "at least 1"), "eval_conversations": (lambda v: v >= 0, "at least 0"),
    "max_len": (lambda v: v >= 32, "at least 32"), "max_new_tokens": (lambda v: v >= 1, "at least 1"),
    "temperature": (lambda v: v >= 0, "at least 0"), "gen_max_num_seqs": (lambda v: v >= 1, "at least 1"),
    "draft_vocab_size": (lambda v: v >= 1, "at least 1"), "ttt_length": (lambda v: v >= 1, "at least 1"),
    "ttt_decay": (lambda v: 0 < v <= 1, "in (0, 1]"), "batch_size": (lambda v: v >= 1, "at least 1"),
    "epochs": (lambda v: v > 0, "above 0"), "steps": (lambda v: v is None or v >= 1, "at least 1"),
    "lr": (lambda v: v > 0, "above 0"), "warmup": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "clip": (lambda v: v > 0, "above 0"), "checkpoint_every": (lambda v: v >= 1, "at least 1"),
    # (the generation engine's own check named its --kv-cache-gb, a flag train-draft does not have)
    "gen_kv_cache_gb": (lambda v: v is None or v > 0, "above 0"),
}


def check_args(args: argparse.Namespace) -> None:
    for name, (ok, rule) in ARG_RULES.items():
        value = getattr(args, name)
        if not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value}")


def train(args: argparse.Namespace, on_step=None) -> TrainResult:
    """on_step(step) runs after every optimizer step (progress hooks, tests)."""
    from oasiskv.engine.engine import pick_device, pick_dtype

    check_args(args)
    t0 = time.perf_counter()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if device.type != "cuda" and dtype != torch.float32:  # autocast runs on a GPU only
        raise ValueError(f"--dtype {args.dtype} trains on a GPU; on the CPU the target runs in float32 (--dtype auto)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file, not a directory")
    earlier = [name for name in ("data.pt", "checkpoint.pt") if os.path.isfile(os.path.join(args.out, name))]
    if earlier and not args.resume:  # a run killed before its first checkpoint leaves data.pt alone
        raise ValueError(f"{args.out} holds an earlier run's {' and '.join(earlier)}: --resume reuses its data and "
                         "continues its training; to start again, give another --out or remove them")
    if args.resume and not earlier:  # (it generated the data again and trained from scratch, saying nothing)
        raise ValueError(f"--resume: {args.out} holds no earlier run (data.pt or checkpoint.pt) to continue; "
                         "leave --resume out to start one")
    os.makedirs(args.out, exist_ok=True)
    target, conversations = target_and_data(args, device, dtype)
    t_data = time.perf_counter() - t0
    held_out = min(args.eval_conversations, len(conversations) // 4)
    train_set, eval_set = conversations[held_out:], conversations[:held_out]
    vocab_ids = draft_data.draft_vocabulary(train_set, target.config.vocab_size, args.draft_vocab_size).to(device)
    head = new_head(target, vocab_ids, args.seed)
    losses = fit(head, target, train_set, vocab_ids, args, device, dtype, on_step)
    t_train = time.perf_counter() - t0 - t_data
    accuracy = evaluate(head, target, eval_set, vocab_ids, args, device, dtype)
    save_eagle3(head, args.out, SAVE_DTYPES[args.save_dtype])
    times = {"data_s": t_data, "train_s": t_train, "total_s": time.perf_counter() - t0}
    write_record(args, len(train_set), accuracy, times)
    return TrainResult(head, losses, accuracy, times)


# -- target and data ------------------------------------------------------------------------------------


def target_and_data(args, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, list[Conversation]]:
    data_path = os.path.join(args.out, "data.pt")
    if args.resume and os.path.isfile(data_path):
        from oasiskv.models.loader import load_model

        conversations = draft_data.load_conversations(data_path, data_settings(args))
        target = load_model(args.model, args.load_format, device, dtype, args.seed).model
        vocab = target.config.vocab_size
        if any(t >= vocab for c in conversations for t in c.token_ids):
            raise ValueError(f"{data_path} holds token ids past this target's vocabulary of {vocab}: it was "
                             "generated by another model; give another --out to start again")
        return target, conversations
    target, conversations = regenerate_data(args, device)
    draft_data.save_conversations(data_path, conversations, data_settings(args))
    return target, conversations


def data_settings(args) -> dict:
    """What makes data.pt: the target (a path as its real path) and the generation flags."""
    model = args.model
    if model is not None and os.path.exists(model):
        model = os.path.realpath(model)
    return {"model": model or "(embedded default)", "load_format": args.load_format,
            "num_conversations": args.num_conversations, "max_len": args.max_len,
            "max_new_tokens": args.max_new_tokens, "temperature": float(args.temperature), "seed": args.seed}


def regenerate_data(args, device: torch.device) -> tuple[CausalLM, list[Conversation]]:
    from oasiskv.api import LLM

    kv_gb = args.gen_kv_cache_gb or (GPU_GEN_KV_GB if device.type == "cuda" else None)
    llm = LLM(args.model, load_format=args.load_format, device=str(device), dtype=args.dtype, seed=args.seed,
              max_model_len=args.max_len, max_num_seqs=args.gen_max_num_seqs, kv_cache_gb=kv_gb)
    prompts = draft_data.chat_prompts(llm.tokenizer, args.num_conversations, args.max_len // 2, args.seed)
    conversations = draft_data.regenerate(llm, prompts, args.max_len, args.max_new_tokens, args.temperature,
                                          args.seed)
    target = llm.engine.model
    del llm  # frees the engine's KV cache before training
    gc.collect()
    replies = sum(len(c.token_ids) - c.prompt_len for c in conversations)
    print(f"regenerated {len(conversations)} conversations ({replies} reply tokens)")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        print(f"GPU memory held after freeing the engine: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB")
    return target, conversations


# -- the head -------------------------------------------------------------------------------------------


def new_head(target: CausalLM, vocab_ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A fresh fp32 head (PyTorch's default init; starting lm_head from the target's rows learned more
    slowly in a CPU trial on SmolLM2)."""
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target.config, len(vocab_ids))
    embedding = target.model.embed_tokens.weight
    with torch.device(embedding.device):
        head = Eagle3Head(cfg, embedding)
    with torch.no_grad():
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids), device=vocab_ids.device))
    return head


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on a GPU unless the target runs in fp32; bf16 even for an fp16 target, so that no
    loss scaling is needed."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and dtype != torch.float32)


def total_steps(args, num_train: int) -> int:
    if args.steps:
        return args.steps
    return max(1, math.ceil(args.epochs * math.ceil(num_train / args.batch_size)))


def lr_factor(step: int, steps: int, warmup: float) -> float:
    warm = max(1, int(warmup * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def fit(head, target, conversations, vocab_ids, args, device, dtype, on_step) -> list[float]:
    steps = total_steps(args, len(conversations))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, args.warmup))
    start = load_checkpoint(args, head, opt, sched, steps) if args.resume else 0
    lengths = [len(c.token_ids) for c in conversations]
    batches = itertools.islice(draft_data.schedule(lengths, args.batch_size, args.seed, steps), start, None)
    bar = tqdm(total=steps, initial=start, desc="train-draft", dynamic_ncols=True)
    losses, smoothed = [], None
    with interrupts_between_steps() as interrupted:
        for step, indices in enumerate(batches, start=start):
            loss, smoothed = train_step(head, target, conversations, indices, vocab_ids, args, device, dtype, opt,
                                        sched, smoothed)
            losses.append(loss)
            bar.set_postfix_str(f"loss {loss:.3f} acc {' '.join(f'{a:.2f}' for a in smoothed)}")
            bar.update(1)
            saved = (step + 1) % args.checkpoint_every == 0 or step + 1 == steps
            if saved:
                save_checkpoint(args, head, opt, sched, step + 1, steps)
            if on_step:
                on_step(step + 1)
            if interrupted():  # Ctrl-C or a kill: the steps since the last checkpoint are kept
                if not saved:
                    save_checkpoint(args, head, opt, sched, step + 1, steps)
                bar.close()
                print(f"interrupted: checkpoint saved at step {step + 1} of {steps} (a second Ctrl-C during a step "
                      "stops at once)")
                raise KeyboardInterrupt
    bar.close()
    return losses


def train_step(head, target, conversations, indices, vocab_ids, args, device, dtype, opt, sched,
               smoothed) -> tuple[float, list[float]]:
    """One optimizer step; (its loss, the running accuracy per unrolled step)."""
    batch = draft_data.make_batch([conversations[i] for i in indices], device)
    targets = target_pass(target, batch, head.capture_layers, vocab_ids)
    with autocast(device, dtype):
        result = unroll(head, batch, targets, args.ttt_length, args.ttt_decay)
    opt.zero_grad(set_to_none=True)
    result.loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
    opt.step()
    sched.step()
    accuracy = [float(c) / max(1, int(n)) for c, n in zip(result.correct, result.counted)]
    smoothed = accuracy if smoothed is None else [0.9 * s + 0.1 * a for s, a in zip(smoothed, accuracy)]
    return result.loss.item(), smoothed


@torch.no_grad()
def evaluate(head, target, conversations, vocab_ids, args, device, dtype) -> list[float]:
    """Top-1 accuracy per unrolled step on held-out conversations (draft argmax mapped through d2t
    against the target's argmax, over every reply prediction); empty when none are held out."""
    if not conversations:
        return []
    correct, counted = [0] * args.ttt_length, [0] * args.ttt_length
    for start in range(0, len(conversations), args.batch_size):
        batch = draft_data.make_batch(conversations[start:start + args.batch_size], device)
        with autocast(device, dtype):
            result = unroll(head, batch, target_pass(target, batch, head.capture_layers, vocab_ids),
                            args.ttt_length, args.ttt_decay)
        correct = [a + int(c) for a, c in zip(correct, result.correct)]
        counted = [a + int(n) for a, n in zip(counted, result.counted)]
    return [c / max(1, n) for c, n in zip(correct, counted)]


# -- checkpoints and records ----------------------------------------------------------------------------


# the flags that shape the optimisation: a resumed run must keep them (the optimizer and schedule states restore the
# old learning rate, and the batches follow the seed and the step count)
RESUME_FLAGS = ("lr", "warmup", "batch_size", "seed", "ttt_length", "ttt_decay", "clip")


def run_settings(args, steps: int) -> dict:
    return {"steps": steps, **{name: getattr(args, name) for name in RESUME_FLAGS}}


def save_checkpoint(args, head, opt, sched, step: int, steps: int) -> None:
    path = os.path.join(args.out, "checkpoint.pt")
    state = {"step": step, "head": head.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "settings": run_settings(args, steps)}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves the previous checkpoint intact


def load_checkpoint(args, head, opt, sched, steps: int) -> int:
    path = os.path.join(args.out, "checkpoint.pt")
    if not os.path.isfile(path):
        print(f"--resume: no {path} yet, starting at step 0")
        return 0
    try:
        state = torch.load(path, map_location=head.d2t.device, weights_only=True)
    except Exception as e:  # truncated or foreign: one line naming it
        raise ValueError(f"{path} cannot be read as a train-draft checkpoint ({type(e).__name__}: {e}); move it "
                         "away to start the training again") from None
    if state["head"]["d2t"].shape != head.d2t.shape or not torch.equal(state["head"]["d2t"], head.d2t):
        raise ValueError(f"{path} was trained with another draft vocabulary (different data or --draft-vocab-size)")
    try:
        head.load_state_dict(state["head"])
    except RuntimeError as e:  # another target's head (other dimensions)
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise ValueError(f"{path} holds a head for another target ({first}); give another --out to start "
                         "again") from None
    check_settings(path, state.get("settings"), run_settings(args, steps))
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    print(f"--resume: continuing at step {state['step']}")
    return state["step"]


def check_settings(path: str, saved: dict | None, now: dict) -> None:
    """Refuses to resume with other optimisation flags: they would be dropped (the saved optimizer's learning
    rate wins) or mix two schedules in one run."""
    if saved is None:  # (a checkpoint written before the settings were saved)
        return
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        flags = ", ".join(f"{'--steps (or --epochs)' if k == 'steps' else '--' + k.replace('_', '-')} {old} "
                          f"(now {new})" for k, (old, new) in changed.items())
        raise ValueError(f"{path} was trained with {flags}: resume with the same flags, or give another --out to "
                         "start again")


def write_record(args, num_train: int, accuracy: list[float], times: dict) -> None:
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    record = {"args": settings, "train_conversations": num_train,
              "eval_top1_per_step": accuracy, "times_s": times}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=2, default=str)
