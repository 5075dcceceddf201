"""Triton 3.6's interpreter (the Triton of torch 2.11, the GPU machine's) turns a tensor into a Python int with
int(data), which NumPy refuses for the one-element arrays a scalar load gives there ("only 0-dimensional arrays can
be converted to Python scalars"), so every kernel whose loop bound is loaded from memory (`range(1, n_tok, BLOCK)`)
fails under TRITON_INTERPRET=1; compiled, those loops run. Later releases squeeze the array first. This gives an
interpreter without that squeeze the later rule, so the kernel tests run under either Triton."""
from __future__ import annotations

import inspect


def squeeze_interpreted_indices() -> bool:
    """Patches the interpreter where its tensor-to-int lacks the squeeze; True when it patched."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_indices", False) or "squeeze()" in inspect.getsource(original):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_indices = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
