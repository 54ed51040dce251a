"""Suite-wide settings: keep torch from oversubscribing the CI's 2 cores.

A test process and the engine servers it starts run at the same time, so each gets one torch
thread: the environment is inherited by every subprocess (``CONFKV_THREADS`` is read by
``confkv serve``), and this process sets its own torch thread count.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CONFKV_THREADS"):
    os.environ.setdefault(_var, "1")


def pytest_configure() -> None:
    try:
        import torch
    except ImportError:  # tests that do not need torch still run
        return
    torch.set_num_threads(1)
    # Triton reads TRITON_INTERPRET once, when triton.language is first imported (torch.compile's
    # tests may import it long before the paged kernels' tests): without CUDA the kernels run under
    # the interpreter, so it is on for the whole session. With CUDA the compiled kernel is tested.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
