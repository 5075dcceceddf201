"""Where kernel tests put their tensors. Under the interpreter (the default, set by conftest) the
kernels run on the CPU; on a GPU machine with TRITON_INTERPRET=0 the tests move their inputs to the
GPU, so the compiled kernels are what they check (CPU tensors would take the torch fallbacks)."""
import os
import subprocess
import sys

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_without_interpreter(code: str) -> None:
    """Runs `code` in a Python process without TRITON_INTERPRET (the kernels' ahead-of-time compile checks,
    compile_for, need no GPU but the real compiler) and fails the test with its stderr if it fails."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
