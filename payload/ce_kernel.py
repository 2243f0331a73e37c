"""--ce-kernel triton: a token's cross-entropy and its gradient in one Triton kernel.

A compiled GPT-2 124M step on an H200 spent 21 ms of its 240 ms in the cross-entropy: two
passes over the 12.7 GB of bf16 logits, the forward reading them and the backward reading them
again and writing an fp32 gradient (docs/benchmarks.md, 2026-12-04). This kernel makes the
loss and the gradient in the forward pass, in place: each program takes one token's row, reads
it once for its max and sum of exponentials (online), then again for softmax minus one-hot,
written over the logits they came from. The row's arithmetic is fp32 whatever the logits' dtype.

Liger-Kernel's cross-entropy does the same and was tried first; it keeps the loss in the
logits' dtype (a bf16 loss: 8.8125 where the fp32 one is 8.8570) and reads three figures back
to the host per call (.item() and two asserts), so this module has its own 30-line kernel.

triton is imported here and only here: a torch without CUDA and without triton still runs the
payload; `--ce-kernel triton` is refused there (cli.py). On CPU the kernel runs only under
Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported): the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The block a program loads at a time and its warps, as Liger-Kernel's cross-entropy chose
# them on H100s (a 50k vocabulary: two blocks a row).
MAX_BLOCK = 32768
NUM_WARPS = 32


@triton.jit
def _ce_rows_kernel(x_ptr, stride, t_ptr, loss_ptr, V, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x vocabulary passes 2**31 at batch 123
    x_row = x_ptr + row * stride
    target = tl.load(t_ptr + row)
    # pass 1: the row's max and sum of exponentials, online (each block rescales the sum)
    m = float("-inf")
    s = 0.0
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, lse - tl.load(x_row + target).to(tl.float32))
    # pass 2: d(loss)/d(logits) = (softmax - one-hot) * scale, over the logits
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(cols == target, g - 1.0, g) * scale
        tl.store(x_row + cols, g.to(x_ptr.dtype.element_ty), mask=cols < V)


# A custom op (opaque to torch.compile, which calls it as it is): it writes `logits`, so the
# graph knows they are not the logits after it.
@torch.library.custom_op("torchrig::ce_rows_", mutates_args=("logits",))
def ce_rows_(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's cross-entropy (fp32, [rows]) of `logits` ([rows, vocab], row-contiguous)
    against `targets` ([rows], class indices), and `logits` overwritten with the loss's
    gradient, (softmax - one-hot) * scale, in their own dtype."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or not targets.is_contiguous():
        raise ValueError("ce_rows_ needs row-contiguous logits and contiguous targets")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(vocab))
    _ce_rows_kernel[(rows,)](logits, logits.stride(0), targets, loss, vocab, scale,
                             BLOCK=block, num_warps=NUM_WARPS)
    return loss


@ce_rows_.register_fake
def _(logits, targets, scale):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)
