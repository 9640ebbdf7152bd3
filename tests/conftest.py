"""Test-session setup: Triton kernels run under the CPU interpreter when there is no GPU.

The interpreter flag is read when a kernel is defined, so it must be set before the
(lazily imported) kernel module is first imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
