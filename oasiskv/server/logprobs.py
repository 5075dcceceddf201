"""The logprobs objects of the server's responses (completions and chat), from the engine's TokenLogprob
(engine/logprobs.py)."""
from __future__ import annotations

from oasiskv.engine.logprobs import TokenLogprob


class CompletionLogprobs:
    """The `logprobs` object of a /v1/completions choice; keeps the text offset across stream chunks."""

    def __init__(self, token_str):
        self.token_str, self.offset = token_str, 0

    def format(self, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(token_ids, logprobs):
            s = self.token_str(token_id)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self.top_dict(lp))
        return out

    def top_dict(self, lp: TokenLogprob) -> dict[str, float]:
        top = {self.token_str(i): v for i, v in lp.top}
        top.setdefault(self.token_str(lp.token_id), lp.logprob)  # the chosen token is always listed
        return top


def chat_logprobs(token_str, logprobs: list[TokenLogprob]) -> dict:
    """The `logprobs` object of a chat choice: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        s = token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for lp in logprobs]}
