"""When a request stops, and its text, by vLLM's rules: EOS (unless ignored), a stop token, a stop string (after
min_tokens), max_tokens or the model's length. The text is decoded after the prompt's last tokens (vLLM's
detokenization: a SentencePiece word's leading space stays); the token that stopped it (EOS, a stop token) is in
the ids, not in the text, unless include_stop_str_in_output."""
from __future__ import annotations

from oasiskv.engine.request import Request

# a stop string the last token completes lies in the text of this many last tokens (or 8 per character of the
# longest stop string): tokens of a character split over several bytes, a word's pieces
STOP_WINDOW_TOKENS = 64


class StopRules:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len

    def text(self, req: Request, ids: list[int]) -> str:
        """ids' text as a continuation of the request's prompt ("" with detokenize False, as vLLM gives it)."""
        if not req.params.detokenize:
            return ""
        if req.text_context is None:
            req.text_context = self.tokenizer.text_context(req.prompt_token_ids)
        return self.tokenizer.decode_after(req.text_context, ids, req.params.skip_special_tokens)

    def final_text(self, req: Request, reason: str) -> str:
        """The text of a request that stopped for `reason` (a stop string's cut is made by `reason`)."""
        if reason == "stop_string":
            return req.output_text
        hide_last = reason == "stop" and not req.params.include_stop_str_in_output
        return self.text(req, req.output_token_ids[:-1] if hide_last else req.output_token_ids)

    def reason(self, req: Request, token: int) -> str | None:
        """Why the request stops after its last token `token` ("stop", "stop_string", "length"), or None."""
        p = req.params
        reason = self.by_content(req, token) if len(req.output_token_ids) >= p.min_tokens else None
        # (the tokens the host has: with async scheduling the next step's may be pending already)
        if reason is None and (len(req.output_token_ids) >= p.max_tokens or
                               len(req.prompt_token_ids) + len(req.output_token_ids) >= self.max_model_len):
            return "length"
        return reason

    def by_content(self, req: Request, token: int) -> str | None:
        """EOS, a stop token or a stop string (min_tokens reached)."""
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if p.stop and self.stop_string_near_end(req):
            text = self.text(req, req.output_token_ids)
            # as vLLM: a stop string must end after the first min_tokens tokens' text
            start = len(self.text(req, req.output_token_ids[:p.min_tokens])) if p.min_tokens else 0
            found = [(i, s) for s in p.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
            if found:
                cut, stop = min(found, key=lambda f: f[0])  # the earliest; at a tie, the first in the list
                req.output_text = text[:cut + (len(stop) if p.include_stop_str_in_output else 0)]
                req.stop_reason = stop
                return "stop_string"
        return None

    def stop_string_near_end(self, req: Request) -> bool:
        """Whether a stop string is in the text of the output's last tokens. Checked every step, a stop string is new
        only where the last token ends it, so the whole output (decoded every step: quadratic in its length) is read
        only once one is near the end."""
        window = max(STOP_WINDOW_TOKENS, 8 * max(map(len, req.params.stop)))
        if len(req.output_token_ids) <= window:
            return True
        tail = self.tokenizer.decode(req.output_token_ids[-window:], req.params.skip_special_tokens)
        return any(s in tail for s in req.params.stop)
