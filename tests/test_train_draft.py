"""train-draft on a tiny random target (CPU): the loss falls, the saved head reloads to the same
logits, and a run interrupted and resumed ends where an uninterrupted run ends."""
from __future__ import annotations

import itertools
import os
import shutil
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from oasiskv.cli import parser
from oasiskv.config import ModelConfig
from oasiskv.lookahead.draft_data import Conversation, draft_vocabulary
from oasiskv.lookahead.train_draft import train
from oasiskv.lookahead.ttt import unrolled
from oasiskv.models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3
from oasiskv.models.loader import load_model
from oasiskv.policies.attention import sdpa
from tests.test_eagle3 import Causal, one_thread  # noqa: F401  (one_thread: module-wide fixture)

STEPS = 12


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama with peaked next-token distributions (large init), no tokenizer: the engine
    reads and writes bytes (ids 0..255)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-target")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def train_args(target_dir: str, out, *extra: str):
    return parser().parse_args([
        "train-draft", "--model", target_dir, "--out", str(out), "--num-conversations", "20",
        "--eval-conversations", "4", "--max-len", "400", "--max-new-tokens", "32", "--gen-kv-cache-gb", "0.02",
        "--steps", str(STEPS), "--batch-size", "4", "--ttt-length", "3", "--draft-vocab-size", "96", "--lr", "1e-2",
        "--checkpoint-every", "6", "--save-dtype", "float32", *extra])


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    return out, train(train_args(target_dir, out))


def test_loss_falls(trained):
    _, result = trained
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < first - 0.5, result.losses  # nats; the soft CE keeps the target entropy as a floor
    assert len(result.eval_accuracy) == 3 and all(0 <= a <= 1 for a in result.eval_accuracy)


def test_saved_head_reloads_to_identical_logits(trained, target_dir):
    out, result = trained
    target = load_model(target_dir, "auto", torch.device("cpu"), torch.float32, show_progress=False).model
    head = load_eagle3(str(out), target)
    assert torch.equal(head.d2t, result.head.d2t)
    gen = torch.Generator().manual_seed(0)
    ids, features = torch.randint(0, 300, (10,), generator=gen), torch.randn(10, 3 * 64, generator=gen)
    with torch.no_grad():
        got = head.logits(head(ids, features, torch.arange(10), Causal()))
        want = result.head.logits(result.head(ids, features, torch.arange(10), Causal()))
    assert torch.equal(got, want)


class Interrupted(Exception):
    pass


def interrupt_at(step: int):
    def on_step(done: int):
        if done == step:
            raise Interrupted

    return on_step


def test_resume_ends_where_an_uninterrupted_run_ends(trained, target_dir, tmp_path):
    out, result = trained
    shutil.copy(out / "data.pt", tmp_path / "data.pt")  # the same regenerated data
    with pytest.raises(Interrupted):
        train(train_args(target_dir, tmp_path, "--resume"), on_step=interrupt_at(STEPS // 2))
    resumed = train(train_args(target_dir, tmp_path, "--resume"))
    assert len(resumed.losses) == STEPS - STEPS // 2
    assert resumed.losses == result.losses[STEPS // 2:]
    for (name, p), q in zip(resumed.head.named_parameters(), result.head.parameters()):
        assert torch.equal(p, q), name


def test_draft_vocabulary_is_the_most_frequent_reply_tokens_ascending():
    conversations = [Conversation([9, 9, 5, 5, 5, 7], 2), Conversation([9, 3, 3, 9], 1)]  # prompts: 9 9 | 9
    assert draft_vocabulary(conversations, 12, 3).tolist() == [3, 5, 7]  # 5 x3, 3 x2, then 7 before 9
    assert draft_vocabulary(conversations, 12, 6).tolist() == [0, 1, 3, 5, 7, 9]  # unused low ids pad it


class Chain:
    """Inference-time drafting of one slot: the context's K/V, then one key per drafted step."""

    def __init__(self):
        self.k = self.v = None

    def attend(self, layer, q, k, v):
        self.k = k if self.k is None else torch.cat((self.k, k))
        self.v = v if self.v is None else torch.cat((self.v, v))
        return sdpa(q, self.k, self.v, q.shape[-1] ** -0.5, causal=True)


def test_unroll_step_k_equals_drafting_k_tokens_ahead():
    """Slot t at unroll step k computes what drafting from position t does at its step k: real
    context up to t, then its own earlier steps, the token of step k at position t + k."""
    torch.manual_seed(0)
    layer = ModelConfig.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    cfg = Eagle3Config(layer, draft_vocab_size=32, target_hidden_size=24, capture_indices=(2, 3, 4),
                       norm_before_residual=False)
    head = Eagle3Head(cfg, torch.randn(50, 32))
    batch, length, steps = 2, 7, 3
    ids, features = torch.randint(0, 50, (batch, length)), torch.randn(batch * length, 3 * 24)
    with torch.no_grad():
        outs = [out.view(batch, length, -1) for out in unrolled(head, ids, features, steps)]
        for b, t in itertools.product(range(batch), range(length - steps)):
            chain = Chain()
            rows = slice(b * length, b * length + t + 1)
            out = head(ids[b, 1:t + 2], features[rows], torch.arange(t + 1), chain)[-1:]
            torch.testing.assert_close(out[0], outs[0][b, t])
            for k in range(1, steps):
                out = head(ids[b, t + 1 + k:t + 2 + k], out, torch.tensor([t + k]), chain, fed_back=True)
                torch.testing.assert_close(out[0], outs[k][b, t])


def signal_at(step: int, signum: int):
    def on_step(done: int):
        if done == step:
            os.kill(os.getpid(), signum)

    return on_step


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_between_checkpoints_keeps_its_steps(trained, target_dir, tmp_path, signum):
    """Ctrl-C (or a kill) at step 3, between the checkpoints at 6 and 12: the loop stops after that step with a
    checkpoint of it (the steps since the last checkpoint were lost, a kill lost them all), and a resumed run
    still ends where an uninterrupted run ends."""
    out, result = trained
    shutil.copy(out / "data.pt", tmp_path / "data.pt")
    with pytest.raises(KeyboardInterrupt):
        train(train_args(target_dir, tmp_path, "--resume"), on_step=signal_at(3, signum))
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 3
    resumed = train(train_args(target_dir, tmp_path, "--resume"))
    assert resumed.losses == result.losses[3:]
    for (name, p), q in zip(resumed.head.named_parameters(), result.head.parameters()):
        assert torch.equal(p, q), name


def test_unreadable_files_and_a_forgotten_resume_are_one_line_errors(trained, target_dir, tmp_path):
    out, _ = trained
    with pytest.raises(ValueError, match="holds an earlier run's data.pt and checkpoint.pt: --resume reuses"):
        train(train_args(target_dir, out))  # it would regenerate data.pt over the earlier run's
    killed = tmp_path / "killed"  # killed before its first checkpoint: its data alone
    killed.mkdir()
    shutil.copy(out / "data.pt", killed / "data.pt")
    with pytest.raises(ValueError, match="holds an earlier run's data.pt: --resume reuses"):
        train(train_args(target_dir, killed))
    (tmp_path / "data.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="data.pt cannot be read as train-draft data"):
        train(train_args(target_dir, tmp_path, "--resume"))
    shutil.copy(out / "data.pt", tmp_path / "data.pt")
    (tmp_path / "checkpoint.pt").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="checkpoint.pt cannot be read as a train-draft checkpoint"):
        train(train_args(target_dir, tmp_path, "--resume"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        train(train_args(target_dir, tmp_path / "file"))


def test_half_precision_on_the_cpu_is_refused_before_the_target_loads(tmp_path):
    with pytest.raises(ValueError, match="--dtype float16 trains on a GPU"):
        train(train_args("unused", tmp_path / "head", "--dtype", "float16"))


@pytest.mark.parametrize("flag, value, message", [
    ("--num-conversations", "0", "--num-conversations must be at least 1, got 0"),
    ("--lr", "-1", "--lr must be above 0"), ("--ttt-decay", "1.5", r"--ttt-decay must be in \(0, 1\]"),
    ("--warmup", "1", r"--warmup must be in \[0, 1\)"), ("--max-len", "8", "--max-len must be at least 32"),
    ("--gen-kv-cache-gb", "-1", "--gen-kv-cache-gb must be above 0"),  # (the engine's check named --kv-cache-gb)
    ("--resume", None, "--resume: .* holds no earlier run")])  # (it generated data and trained from scratch)
def test_bad_flags_fail_before_the_target_loads(tmp_path, monkeypatch, flag, value, message):
    import oasiskv.lookahead.train_draft as td

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the flags were checked")

    monkeypatch.setattr(td, "target_and_data", no_loading)
    with pytest.raises(ValueError, match=message):
        train(train_args("unused", tmp_path / "head", *[a for a in (flag, value) if a is not None]))
    assert not (tmp_path / "head").exists()  # nothing written either


class TemplateOf30:
    """A chat template that adds 30 tokens to a message of one token per 4 characters."""

    def apply_chat_template(self, messages):
        return [0] * (30 + len(messages[0]["content"]) // 4)


def test_prompts_that_cannot_fit_fail_at_once():
    """--max-len 32 leaves prompts 16 tokens: none fits a 30-token template, which a walk of the whole standard
    library took minutes to find."""
    from oasiskv.lookahead.draft_data import chat_prompts

    with pytest.raises(ValueError, match="the chat template alone takes 30 tokens, and prompts may have 16"):
        chat_prompts(TemplateOf30(), 5, 16, 0)
    assert all(len(ids) <= 200 for ids in chat_prompts(TemplateOf30(), 5, 200, 0))


def tiny_target(path, seed: int, hidden: int = 64) -> str:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=112, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("hidden", [64, 32])
def test_resume_refuses_the_data_and_head_of_another_target(trained, tmp_path, hidden):
    """--resume with another --model reused data.pt (the other target's replies) and checkpoint.pt silently when the
    dimensions matched (and saved that head for this target), and failed with a torch traceback when they did not;
    found by a helper's audit of the drafts."""
    out, _ = trained
    run = tmp_path / "run"
    run.mkdir()
    for name in ("data.pt", "checkpoint.pt"):
        shutil.copy(out / name, run / name)
    other = tiny_target(tmp_path / "other", seed=1, hidden=hidden)
    with pytest.raises(ValueError, match=r"data.pt was generated with other settings \(--model"):
        train(train_args(other, run, "--resume"))


def test_resume_refuses_data_made_with_other_generation_flags(trained, target_dir, tmp_path):
    out, _ = trained
    shutil.copy(out / "data.pt", tmp_path / "data.pt")
    with pytest.raises(ValueError, match=r"--max-new-tokens 32 there, 64 now"):
        train(train_args(target_dir, tmp_path, "--resume", "--max-new-tokens", "64"))


def test_snippets_are_ast_s_segments_cut_from_lines_split_once(tmp_path, monkeypatch):
    """file_snippets called ast.get_source_segment per function, which splits the whole file at every call: quadratic
    (a pass over the standard library: scripts/time_stdlib_snippets.py). The segments are still ast's, line ends
    (\\r\\n, \\r, form feed) and non-ASCII columns included; ast's function is the reference, not called by the code."""
    import ast

    from oasiskv.lookahead import draft_data

    path = tmp_path / "big.py"
    body = "".join(f"def f{i}(x):\n    \"\"\"Doc {i} é.\"\"\"\n    return x + {i}\n\n" for i in range(300))
    odd = "class K:\r\n    def g(self): return 'é'\r\n\x0c\n    def h(self):\r        return 1\r\n"
    path.write_text(odd + body, encoding="utf-8", newline="")
    text = path.read_bytes().decode("utf-8")
    lines, chars = draft_data.SOURCE_LINES, draft_data.SOURCE_CHARS
    expected = {f"big.{n.name}": "\n".join(ast.get_source_segment(text, n).splitlines()[:lines])[:chars]
                for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    def per_node_split(*args, **kwargs):
        raise AssertionError("ast.get_source_segment splits the whole file at each call")

    monkeypatch.setattr(draft_data.ast, "get_source_segment", per_node_split)
    got = {s.name: s.source for s in draft_data.file_snippets(str(path)) if s.name in expected}
    assert got == expected and len(got) == 303


def test_an_interrupt_says_whether_anything_is_left_to_resume(tmp_path):
    """data.pt is written once every reply exists: an interrupt while generating kept nothing, yet the message said
    --resume continues."""
    from oasiskv.lookahead.train_draft import interrupted_message

    assert "lost: run it again (without --resume)" in interrupted_message(str(tmp_path))
    (tmp_path / "data.pt").write_bytes(b"")
    assert interrupted_message(str(tmp_path)).endswith("keeps data.pt: --resume continues")
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert interrupted_message(str(tmp_path)).endswith("keeps data.pt and checkpoint.pt: --resume continues")


@pytest.mark.parametrize("extra, message", [
    (("--lr", "0.05"), r"--lr 0.01 \(now 0.05\)"),
    (("--steps", "16"), r"--steps \(or --epochs\) 12 \(now 16\)"),
    (("--batch-size", "2"), r"--batch-size 4 \(now 2\)")])
def test_resume_refuses_other_optimisation_flags(trained, target_dir, tmp_path, extra, message):
    """--resume with another --lr ran at the saved optimizer's old rate (the new one was dropped, yet training.json
    recorded it), and another --steps continued the old schedule's last rate into the new one; found by a helper's
    audit of the drafts."""
    out, _ = trained
    for name in ("data.pt", "checkpoint.pt"):
        shutil.copy(out / name, tmp_path / name)
    with pytest.raises(ValueError, match=message):
        train(train_args(target_dir, tmp_path, "--resume", *extra))
