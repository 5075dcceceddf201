"""OasisKV: `from oasiskv import LLM, SamplingParams`, as from vllm (loaded on first use: the CLI and the server
start without the offline API)."""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name in __all__:
        from oasiskv import api

        return getattr(api, name)
    raise AttributeError(f"module 'oasiskv' has no attribute {name!r}")
