"""Request models of the OpenAI-compatible API (vLLM's field names) and its error shape."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from oasiskv.sampling_params import MAX_LOGPROBS, VLLM_ONLY_FIELDS



class APIError(Exception):
    """Raised by handlers; turned into vLLM's error body with this status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 500: "InternalServerError",
               502: "BadGatewayError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields vLLM honours and this server does not, with the values that change nothing. Another value is refused (a
# 400 naming the field) rather than ignored: the client would get output it did not ask for. Other unknown fields
# are ignored, as vLLM ignores them.
UNSUPPORTED_FIELDS = {
    "suffix": (None, ""), "use_beam_search": (None, False),
    "tools": (None, []), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}), "logits_processors": (None, []), "tool_choice": (None, "none", "auto"),
    "prompt_logprobs": (None,),
    "length_penalty": (None, 1, 1.0), "chat_template": (None,),
    "priority": (None, 0), "documents": (None, []), "reasoning_effort": (None,), "mm_processor_kwargs": (None, {}),
    "prompt_embeds": (None,), "echo": (None, False),  # (completions declare echo; chat's is the extra)
    # SamplingParams' own at the values that change nothing (detokenize: a response is text)
    **{name: (None, *neutral) for name, neutral in VLLM_ONLY_FIELDS.items()}, "detokenize": (None, True),
}


# Fields vLLM declares Optional with a default (OpenAI's schema: "or null"): a JSON null is the default, as there
NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_p")


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; vLLM extras (top_k, ignore_eos, ...) at the top level."""

    model_config = ConfigDict(extra="allow")  # read by job.refuse_unsupported, then unused

    @model_validator(mode="before")
    @classmethod
    def nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = Field(None, ge=-2 ** 63, le=2 ** 63 - 1)  # vLLM's: an int64
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # None: the model's default (job.sampling_params)
    min_tokens: int = Field(0, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as strings) to biases in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation (vLLM's field): oasiskv/disagg/
    best_of: int | None = None  # vLLM's; only best_of == n (or unset) is served
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens as `token_id:N`
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these can be sampled
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    skip_special_tokens: bool = True  # vLLM's: False keeps the special tokens' text
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens (-1: max_model_len)


TokenIds = list[StrictInt]


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None  # reach the template (e.g. Qwen3's enable_thinking)
    echo: bool = False  # vLLM's: a last assistant message leads the answer
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def top_logprobs_need_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):  # vLLM's rule and message
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return value


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's TokenizeChatRequest: the template's options, as /v1/chat/completions takes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: TokenIds


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
