"""The states a chunked linear recurrence passes between chunks, without a loop over chunks.

For chunks n = 0 .. N-1 with per-chunk updates U_n [E, F] and log decays g_n (<= 0):
    S_0 = initial,   S_{n+1} = exp(g_n) S_n + U_n
so S_n = sum_{j<=n} exp(sum_{j<=l<n} g_l) X_j with X_0 = S_0 and X_j = U_{j-1}: one [N+1, N+1]
lower-triangular matrix of segment sums (each entry summed over its own range, not a difference
of two long cumulative sums, so a long strongly decaying sequence loses no precision) times the
stacked X. The operator count does not depend on N; the work is O(N^2 E F) per head, against
O(N E F) for a loop, which is small beside the chunks' own O(N C E F) while N <= C.

`chunk_states` can run instead the Triton kernels of state_passing_triton.py (a loop over the chunks
with the state in registers: O(N E F), one launch each way); the Titans / deep-memory write loop has
its own (memory_write_triton.py). Both are tested against the torch forms under Triton's CPU
interpreter only: no GPU has run them yet, so `auto` keeps the torch form until one has
(KERNELS_CHECKED_ON_GPU; docs/gpu.md). The choice: the `kernel` argument, else the environment
variable MEGATRON_TAPER_KERNELS (read at every call):
    auto    (default) Triton for CUDA tensors when triton imports and KERNELS_CHECKED_ON_GPU, else
            the torch form (today: always the torch form)
    torch   always the torch form
    triton  always the Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (set
            before triton is first imported; this is how the tests run the kernels without a GPU)
A scan over packed documents (`documents`: a chunk may hand on the initial state, titans/documents.py)
always takes the torch form: the Triton kernels have not been run with such resets.
"""
from __future__ import annotations

import os

import torch

KERNELS_ENV = "MEGATRON_TAPER_KERNELS"
KERNEL_CHOICES = ("auto", "torch", "triton")
# whether a GPU run of benchmarks/gpu_families.py has checked the Triton kernels against the torch
# forms (its compiled_kernels rows' loss differences); until then `auto` means the torch form
KERNELS_CHECKED_ON_GPU = False


def segment_sums(log_decays: torch.Tensor) -> torch.Tensor:
    """log_decays [..., N] -> [..., N+1, N+1] with entry (i, j) = sum_{j<=l<i} g_l for j <= i and
    -inf above the diagonal (so exp of it is the lower-triangular transfer matrix)."""
    n = log_decays.shape[-1] + 1
    steps = torch.nn.functional.pad(log_decays, (1, 0))  # y_0 = 0, y_i = g_{i-1}
    strict = torch.ones(n, n, dtype=torch.bool, device=log_decays.device).tril(-1)
    sums = steps[..., :, None].expand(*steps.shape, n).masked_fill(~strict, 0).cumsum(-2)  # sum_{j<k<=i} y_k
    return sums.masked_fill(~strict.logical_or(torch.eye(n, dtype=torch.bool, device=log_decays.device)),
                            -torch.inf)


def chunk_states(updates: torch.Tensor, log_decays: torch.Tensor, initial: torch.Tensor,
                 kernel: str | None = None, documents: bool = False) -> torch.Tensor:
    """updates [B, H, N, E, F], log_decays [B, H, N], initial [B, H, E, F] -> the states before
    every chunk and after the last, [B, H, N+1, E, F] (index 0 is `initial`). `kernel`: auto |
    torch | triton (None: $MEGATRON_TAPER_KERNELS, else auto; see the module docstring);
    `documents`: log decays of -inf reset the state (the torch form)."""
    if kernel_choice(updates, kernel, documents) == "triton":
        from megatron_taper.models.kernels.state_passing_triton import chunk_states_triton

        return chunk_states_triton(updates, log_decays, initial)
    return chunk_states_torch(updates, log_decays, initial)


def kernel_choice(tensor: torch.Tensor, kernel: str | None = None, documents: bool = False) -> str:
    """'torch' or 'triton' for `tensor`'s device, from `kernel` or $MEGATRON_TAPER_KERNELS (auto when
    neither is set); always 'torch' for a scan over packed documents (module docstring)."""
    choice = kernel if kernel is not None else (os.environ.get(KERNELS_ENV) or "auto")
    if choice not in KERNEL_CHOICES:
        source = "kernel" if kernel is not None else KERNELS_ENV
        raise ValueError(f"{source}={choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    if documents:
        return "torch"
    if choice == "auto":
        return "triton" if KERNELS_CHECKED_ON_GPU and tensor.is_cuda and triton_importable() else "torch"
    if choice == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET", "0").lower() not in (
            "1", "true", "on", "yes"):
        raise ValueError(f"the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for {tensor.device} ones")
    return choice


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def chunk_states_torch(updates: torch.Tensor, log_decays: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """chunk_states as the segment-sum product (every device). Under autocast the product runs in
    the states' own dtype (fp32 for an fp32 initial state), as the loop's elementwise update did:
    a bf16 product would round every state passed on."""
    stacked = torch.cat((initial.unsqueeze(2), updates), dim=2).flatten(3)  # [B, H, N+1, E*F]
    with torch.autocast(stacked.device.type, enabled=False):
        transfer = segment_sums(log_decays).exp().to(stacked.dtype)  # [B, H, N+1, N+1]
        return (transfer @ stacked).unflatten(-1, initial.shape[-2:])
