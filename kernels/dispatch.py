"""Pick the Q4_0 operations for a device: ``get_ops(device).matmul(x, q, out=None)`` / ``.embedding(ids, q)``.

- CPU: the compiled kernels (``kernels.cpu``) when they build and load, else the torch
  reference; ``TANDEM_KERNELS=reference`` forces the reference.
- CUDA: the Triton kernels (``kernels.gpu``) when triton imports, else the torch reference,
  which runs on CUDA tensors as is; ``TANDEM_KERNELS=reference`` forces the reference.
- anything else: the torch reference.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import cpu, q4_0


def get_ops(device: torch.device | str) -> ModuleType:
    """The module whose ``matmul`` / ``embedding`` serve tensors on ``device``."""
    dev = torch.device(device)
    choice = os.environ.get("TANDEM_KERNELS", "auto").lower()
    if choice not in ("auto", "reference"):
        raise ValueError(f"TANDEM_KERNELS must be 'auto' or 'reference', got {choice!r}")
    if choice == "reference":
        return q4_0
    if dev.type == "cpu":
        return cpu if cpu.available() else q4_0
    if dev.type == "cuda":
        from kernels import gpu
        return gpu if gpu.available() else q4_0
    return q4_0


def describe(device: torch.device | str) -> str:
    """One line naming the path ``get_ops(device)`` takes, for logs and benchmarks."""
    ops = get_ops(device)
    if ops is cpu:
        return f"cpu kernels ({cpu.isa()}, {cpu.act()} activations, {cpu.get_num_threads()} threads)"
    if ops.__name__ == "kernels.gpu":
        return "triton kernels (f32 activations)"
    return "torch reference"
