"""The packed step on CUDA: a packed row's log-probs and gradients equal the right-padded full-
logits path for every supported architecture, in float32 (tight) and under bf16 autocast (the
kernels differ: torch's varlen flash kernel where its probe passes, else per-sequence SDPA);
and the compiled head equals the eager one."""

from __future__ import annotations

import pytest
import torch

from rollmesh.algorithms import head
from rollmesh.models.varlen import _torch_varlen_usable, use_packed_attention
from rollmesh.training import batching
from rollmesh.training.forward import token_logprobs_of
from tests.unit.test_packed_step import _batch, _model, _old_path

CUDA = torch.device("cuda")


class _State:
    def __init__(self, autocast: bool):
        self.temperature, self.device, self.autocast = 1.0, CUDA, autocast
        self.compute_dtype = torch.bfloat16


def _compare(arch: str, autocast: bool) -> tuple[float, float]:
    data = _batch()
    rows = list(range(data.size))
    model = _model(arch).float().to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        mb = {k: v.to(CUDA) for k, v in data.rows(rows).items()}
        logits = model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"]).logits
    from rollmesh.algorithms.logits import token_logprobs

    want = token_logprobs(logits, mb["tokens"], 1.0, shift=True) * mb["mask"]
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    use_packed_attention(model, CUDA)
    packed = batching.model_inputs(data.rows(rows), packed=True)
    packed = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    got, _ = token_logprobs_of(_State(autocast), model, packed)
    got.sum().backward()
    grad_err = max(float((p.grad - want_grads[n]).abs().max())
                   / (float(want_grads[n].abs().max()) + 1e-6)
                   for n, p in model.named_parameters())
    return float((got - want).abs().max()), grad_err


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "gemma2"])
def test_packed_equals_padded_on_cuda_float32(arch):
    err, grad_err = _compare(arch, autocast=False)
    assert err < 1e-4 and grad_err < 1e-3, (err, grad_err)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_packed_equals_padded_on_cuda_bf16(arch):
    err, grad_err = _compare(arch, autocast=True)
    print(arch, "bf16 max |logp diff|", err, "grad rel", grad_err,
          "torch varlen:", _torch_varlen_usable(torch.zeros(1, 4, 8, 16, device=CUDA,
                                                            dtype=torch.bfloat16)))
    assert err < 0.1 and grad_err < 0.1, (err, grad_err)


def test_compiled_head_equals_eager_on_cuda():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    hidden = torch.randn(700, 64, device=CUDA, generator=gen)
    weight = torch.randn(5000, 64, device=CUDA, generator=gen) * 0.1
    targets = torch.randint(0, 5000, (700,), device=CUDA, generator=gen)
    out = []
    for on in (False, True):
        head.set_compile(on)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = head.head_logprobs(h, w, targets, entropy="grad", chunk=256)
        (lp.sum() + ent.sum()).backward()
        out.append((lp.detach(), ent.detach(), h.grad, w.grad))
    head.set_compile(False)
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
