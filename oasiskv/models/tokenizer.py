"""Tokenizers: transformers' (from a GGUF file or an HF directory), or bytes for random-weight models."""
from __future__ import annotations

import functools
import os
from typing import Sequence

PRIMING_TOKENS = (4, 24)  # how many prompt tokens an output is decoded after (HFTokenizer.text_context)
UTF8_MAX_BYTES = 4


def whole_characters(text: str) -> str:
    """The text without the replacement characters an unfinished UTF-8 character leaves at its end (a multi-byte
    character split over tokens, cut by the length limit): vLLM's detokenizer never shows those bytes."""
    return text.rstrip("\ufffd")


class HFTokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    @classmethod
    def from_gguf(cls, path: str) -> "HFTokenizer":
        stat = os.stat(path)
        try:
            return cls(_gguf_tokenizer(os.path.abspath(path), stat.st_mtime_ns, stat.st_size))
        except (ValueError, KeyError, TypeError) as e:  # (no vocabulary, or one transformers cannot build)
            raise ValueError(f"{path}: no tokenizer can be built from this GGUF ({type(e).__name__}: {e})") from None

    @classmethod
    def from_dir(cls, path: str) -> "HFTokenizer":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a broken file: say which directory
            raise ValueError(f"the tokenizer files in {path} cannot be read ({type(e).__name__}: {e})") from None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return () if self.hf.eos_token_id is None else (int(self.hf.eos_token_id),)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of text that follows other ids (no BOS or other special tokens added)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_after(self, context: Sequence[int], ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ids as a continuation of the prompt, as vLLM's incremental detokenizer gives it: decoded
        after the prompt's last tokens (`context`, from text_context), whose own text is then cut off. Decoded
        alone, a SentencePiece token's word-start marker at the beginning is dropped (" Paris" came out "Paris");
        byte-level BPE gives the same text either way. skip_special_tokens False keeps the special tokens' text.
        An unfinished character at the end is left out: the text of the ids before its bytes (byte fallback's
        decoder turns a whole run of byte tokens into U+FFFD when its last character is unfinished, so stripping
        the U+FFFDs took the run's finished characters too), else the text without its trailing U+FFFDs."""
        text = self._text_after(context, ids, skip_special_tokens)
        if not text.endswith("\ufffd"):
            return text
        for cut in range(1, min(UTF8_MAX_BYTES, len(ids) + 1)):  # the unfinished character's 1 to 3 bytes
            shorter = self._text_after(context, ids[:len(ids) - cut], skip_special_tokens)
            if not shorter.endswith("\ufffd"):
                return shorter
        return whole_characters(text)

    def _text_after(self, context: Sequence[int], ids: Sequence[int], skip_special_tokens: bool) -> str:
        if not context:
            return self.decode(ids, skip_special_tokens)
        before = self.decode(context, skip_special_tokens)
        whole = self.decode(list(context) + list(ids), skip_special_tokens)
        return whole[len(before):] if whole.startswith(before) else self.decode(ids, skip_special_tokens)

    def text_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt tokens an output is decoded after (once per request): the last 4 to 24, the fewest that
        start on a whole character (vLLM's priming of its decode stream); all of a shorter prompt."""
        ids = list(prompt_ids)
        if len(ids) <= PRIMING_TOKENS[0]:
            return ids
        for n in range(PRIMING_TOKENS[0], min(len(ids), PRIMING_TOKENS[1]) + 1):
            if "\ufffd" not in self.decode(ids[-n:]):
                return ids[-n:]
        return ids[-PRIMING_TOKENS[0]:]

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **template_kwargs) -> list[int]:
        """The conversation's prompt ids; template_kwargs reach the template (e.g. Qwen3's enable_thinking)."""
        return self.encode_continuation(self.render_chat(messages, chat_template, add_generation_prompt,
                                                         continue_final_message, **template_kwargs))

    def render_chat(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs) -> str:
        """The conversation's prompt text. A template that fails (its syntax, its raise_exception, an option it
        cannot take) is a ValueError naming the cause, as vLLM reports it."""
        if not (chat_template or getattr(self.hf, "chat_template", None)):
            raise ValueError("this model's tokenizer has no chat template; use generate with a plain prompt")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message continues the last message: set add_generation_prompt=False")
        reserved = sorted(set(template_kwargs) & {"tokenize", "conversation", "messages", "return_dict"})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the engine sets them")
        try:
            return self.hf.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, **template_kwargs)
        except Exception as e:  # noqa: BLE001 - jinja2's syntax and template errors, transformers' checks
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e


class ByteTokenizer:
    """For random-weight models, which ship no tokenizer: UTF-8 bytes are ids 0..255; other ids
    (a random model emits any id of its vocabulary) decode as <id>."""

    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_continuation = encode  # bytes add no special tokens

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:  # (bytes have no special tokens)
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            out.append(f"<{i}>")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def text_context(self, prompt_ids: Sequence[int]) -> list[int]:
        return []  # bytes: no token's text depends on what comes before it

    def decode_after(self, context: Sequence[int], ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return whole_characters(self.decode(ids))

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **template_kwargs) -> list[int]:
        return self.encode(self.render_chat(messages, chat_template, add_generation_prompt, continue_final_message,
                                            **template_kwargs))

    def render_chat(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs) -> str:
        if chat_template or continue_final_message or template_kwargs:
            raise ValueError("a model without a tokenizer has no chat template to take these options")
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt
                                                                              else "")


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int):
    """Building a fast tokenizer from a GGUF's vocabulary takes seconds: once per file (gguf_meta's disk cache),
    then read once per process. The tokenizer is only read, so engines share it."""
    from oasiskv.models import gguf_meta

    return gguf_meta.tokenizer(path, mtime_ns, size)
