"""tests/triton_compat.py: under an interpreter that turns a tensor into an int as Triton 3.6's does (int() of the
array, refused for one element of one dimension), a kernel whose loop bound is loaded from memory fails, and runs
once the compat has patched that interpreter. The kernel's result is checked against the host's n-gram lookup."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.ngram_lookup import ngram_lookup  # noqa: E402
from oasiskv.lookahead.ngram import NgramDraft  # noqa: E402

from tests.kernel_device import INTERPRETED  # noqa: E402
from tests.test_kernel_ngram_lookup import paged_contexts  # noqa: E402
from tests.triton_compat import squeeze_interpreted_indices  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="patches the Triton interpreter; compiled kernels need none")


@pytest.fixture
def interpreter_as_in_triton_3_6(monkeypatch):
    """The running interpreter, with 3.6's tensor-to-int put back (restored after the test)."""
    import triton.runtime.interpreter as interpreter

    current = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        current(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
    return interpreter


def lookup(lengths):
    pool, tables, contexts = paged_contexts(lengths, 4, 7, seed=3)
    out = torch.full((len(lengths),), -1)
    ngram_lookup(pool, tables, torch.tensor(lengths, dtype=torch.int32), out, 3, 1)
    return out.tolist(), [NgramDraft(max_n=3, min_n=1).lookup("r", c) for c in contexts]


def test_a_loaded_loop_bound_fails_in_3_6s_interpreter_and_runs_once_patched(interpreter_as_in_triton_3_6):
    with pytest.raises(Exception, match="0-dimensional arrays"):
        lookup([5, 40])
    assert squeeze_interpreted_indices()
    assert not squeeze_interpreted_indices()  # once is enough
    found, expected = lookup([5, 40])
    assert found == expected
