"""Ahead-of-time compiles of Triton kernels for a CUDA architecture, with no GPU present (Triton's bundled
ptxas): tests use them to check the GPU lowering that the interpreter cannot (sorts, gathers, reductions)."""
from __future__ import annotations

import triton


def compile_ahead(kernel, pointers: dict[str, str], meta: dict, arch: int, num_warps: int = 4,
                  scalars: dict[str, str] | None = None):
    """Compiles `kernel` for compute capability `arch` (90: H100/H200). `pointers`: the types of its pointer
    arguments; `meta`: its constants; `scalars`: types of scalar arguments other than int32. Needs
    TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    names, types = kernel.arg_names, {**(scalars or {}), **pointers}
    signature = {n: types.get(n, "constexpr" if n in meta else "i32") for n in names}
    constexprs = {(names.index(n),): v for n, v in meta.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps})
