"""POST /v1/chat/completions: messages through the model's chat template; streaming deltas."""
from __future__ import annotations

from fastapi.responses import Response

from oasiskv.server.generation import Choice, Submission
from oasiskv.server.job import GenerationJob, check_context, max_tokens_of, sampling_params, truncated_prompt
from oasiskv.server.logprobs import chat_logprobs
from oasiskv.server.protocol import APIError, ChatCompletionRequest


def chat_prompt(body: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    for name in ("chat_template", "tokenize", "messages"):  # (the first would replace the model's template)
        if name in kwargs:
            raise APIError(f"chat_template_kwargs cannot set `{name}`: this server renders the model's own chat "
                           f"template", param="chat_template_kwargs")
    # vLLM's merge: the template's options in chat_template_kwargs win over the top-level fields
    options = {"add_generation_prompt": body.add_generation_prompt,
               "continue_final_message": body.continue_final_message, **kwargs}
    try:
        ids = tokenizer.apply_chat_template(messages, **options)
    except ValueError as e:  # (a template that fails on the conversation, e.g. roles out of order, included)
        raise APIError(str(e), param="messages") from e
    if not ids:
        raise APIError("the messages produced an empty prompt", param="messages")
    return ids


class ChatJob(GenerationJob):
    object_name, id_prefix = "chat.completion.chunk", "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, state):
        super().__init__(body, state)
        self.prompt = truncated_prompt(body, chat_prompt(body, state.tokenizer), state.max_model_len)
        self.num_prompt_tokens = len(self.prompt)
        requested = body.max_completion_tokens or body.max_tokens
        check_context(len(self.prompt), requested, state.max_model_len, "messages")
        max_tokens = max_tokens_of(state, len(self.prompt), requested)
        self.params = [sampling_params(body, max_tokens, i, state.sampling_defaults) for i in range(body.n)]
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        last = body.messages[-1]  # vLLM's echo: the last message leads the answer where it is the assistant's
        self.echo = last.text() if body.echo and last.role == "assistant" else ""

    async def start(self) -> None:
        self.sub = await Submission.start(self.state.loop, [self.prompt] * len(self.params), self.params,
                                          self.top_logprobs, self.body.kv_transfer_params, prompt_param="messages")

    def logprobs(self, logprobs) -> dict | None:
        return chat_logprobs(self.token_str, logprobs) if self.top_logprobs is not None else None

    def response(self, choices: list[Choice]) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": self.echo + c.text},
                             "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason} for i, c in enumerate(choices)],
                "usage": self.usage(sum(len(c.token_ids) for c in choices))}

    async def chunks(self):
        for i in range(len(self.params)):  # the first delta of each choice carries the role
            yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])
            if self.echo:
                yield self.chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                   "finish_reason": None}])
        async for d in self.deltas():
            self.count_streamed(d.index, d.token_ids)
            delta = {"content": d.text} if d.text or not d.finish_reason else {}
            yield self.chunk([{"index": d.index, "delta": delta, "logprobs": self.logprobs(d.logprobs),
                               "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])


async def create_chat_completion(body: ChatCompletionRequest, state, request) -> Response:
    job = ChatJob(body, state)
    await job.start()
    return await job.respond(request)
