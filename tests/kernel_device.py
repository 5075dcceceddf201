"""Where kernel tests put their tensors. Under the interpreter (the default, set by conftest) the
kernels run on the CPU; on a GPU machine with TRITON_INTERPRET=0 the tests move their inputs to the
GPU, so the compiled kernels are what they check (CPU tensors would take the torch fallbacks)."""
import os

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
