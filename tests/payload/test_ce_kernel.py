"""payload/ce_kernel.py: the Triton cross-entropy against torch's, in Triton's interpreter (there
is no GPU here: the same kernel source, run block by block on the CPU). What a GPU adds, the
speed, is bench/gpu_check.sh's candidate ce-triton."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"
sys.path.insert(0, str(PAYLOAD))
import model  # noqa: E402


@pytest.fixture(scope="module")
def ce_kernel():
    """The module, its kernel made in the interpreter: triton.jit reads TRITON_INTERPRET when
    the module is imported."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield importlib.import_module("ce_kernel")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_each_rows_loss_and_the_gradient_written_over_the_logits(ce_kernel, monkeypatch, dtype,
                                                                 tol):
    # 200 classes in blocks of 64: three whole blocks and a part, so the running max and sum
    # carry across blocks; scaled so that a later block holds a row's max
    monkeypatch.setattr(ce_kernel, "MAX_BLOCK", 64)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=g) * torch.linspace(1, 8, 200)).to(dtype)
    t = torch.randint(0, 200, (37,), generator=g)
    ref_x = x.float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_x, t, reduction="none")
    ref.sum().backward()
    logits = x.clone()
    loss = ce_kernel.ce_rows_(logits, t, 0.5)
    assert loss.dtype == torch.float32  # whatever the logits' dtype
    assert torch.allclose(loss, ref.detach(), rtol=1e-6, atol=1e-5 if dtype == torch.bfloat16
                          else 1e-6)
    assert logits.dtype == dtype  # now the gradient, scaled, in the logits' own dtype
    assert torch.allclose(logits.float(), 0.5 * ref_x.grad, atol=tol)
    assert (logits.float().sum(1).abs() < 40 * tol).all()  # softmax sums to the one-hot's 1


def test_refuses_logits_it_would_read_wrongly(ce_kernel):
    x = torch.randn(8, 6)
    with pytest.raises(ValueError, match="row-contiguous"):
        ce_kernel.ce_rows_(x.t(), torch.zeros(6, dtype=torch.long), 1.0)


@pytest.mark.parametrize("chunks", [0, 5])
def test_the_model_trains_through_it_as_through_torchs(ce_kernel, chunks):
    """The Triton kernel in the model (one chunk, or five): torch's loss and every parameter's
    gradient, the tied embedding's from both of its uses."""
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(2))
    runs = {}
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        m = model.build_model("tiny", 64, ce_chunks=chunks if kernel == "triton" else 0,
                              ce_kernel=kernel)
        logits, loss = m(x, y)
        loss.backward()
        runs[kernel] = (logits, loss.item(), {n: p.grad for n, p in m.named_parameters()})
    assert runs["torch"][0].shape == (3, 64, 256) and runs["triton"][0] is None
    assert runs["triton"][1] == pytest.approx(runs["torch"][1], rel=1e-6)
    assert all(torch.allclose(runs["triton"][2][n], g, rtol=1e-4, atol=1e-6)
               for n, g in runs["torch"][2].items())
    with torch.no_grad():  # evaluation: torch's own operations, nothing written over
        assert m(x, y)[1].item() == pytest.approx(runs["triton"][1], rel=1e-6)
