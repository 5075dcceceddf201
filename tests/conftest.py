"""Session fixtures: the embedded SmolLM2 model, loaded once by us and once by transformers."""
from __future__ import annotations

import os

# Triton kernels run on the CPU under the interpreter; it must be set before triton is imported.
# Engine code on the CPU calls the torch references directly, so only kernel tests use it. On a GPU
# machine, TRITON_INTERPRET=0 tests the compiled kernels on the device.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.triton_compat import squeeze_interpreted_indices  # noqa: E402

squeeze_interpreted_indices()

# `make test` runs the suite in pytest-xdist workers: they share the cores rather than each taking all
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // _workers)))


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first: `make test`'s workers then share the short ones at the end, instead
    of one worker starting a several-minute test while the other runs out of work."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def gguf_dequantized_once():
    """Most test files build engines of the embedded model: its GGUF is dequantized once per session
    (load_weights copies the tensors into each model, so no engine shares or changes them)."""
    from oasiskv.models import loader

    original, cache = loader.gguf_tensors, {}

    def cached(path, cfg):
        key = os.path.abspath(path)
        if key not in cache:
            cache[key] = list(original(path, cfg))
        return iter(cache[key])

    loader.gguf_tensors = cached
    yield
    loader.gguf_tensors = original


@pytest.fixture(scope="session")
def smollm_llm():
    from oasiskv.api import LLM

    return LLM(show_progress=False, max_num_batched_tokens=512, kv_cache_gb=0.25)


@pytest.fixture(scope="session")
def smollm_hf():
    from transformers import AutoModelForCausalLM

    from oasiskv.models.loader import embedded_default_path

    path = embedded_default_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm_hf_tokenizer():
    from transformers import AutoTokenizer

    from oasiskv.models.loader import embedded_default_path

    path = embedded_default_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is faster, and far faster on a busy machine (no waits on a descheduled peer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
