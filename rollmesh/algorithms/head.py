"""Log-probs and entropy straight from the last hidden states: the LM head, chunk by chunk.

    z = softcap(h @ W^T + b) / temperature        (softcap(x) = c tanh(x / c), Gemma2; else x)
    logp[i] = log softmax(z_i)[target_i],   H[i] = -sum_v p_iv log p_iv

`head_logprobs` computes both for M rows of hidden states, `chunk` rows at a time: one chunk's
logits [chunk, V] exist at a time, in the forward and again in the backward (recomputed), so
neither the [M, V] logits nor their gradient ever exist whole (the approach of Liger's fused
linear cross-entropy and of cut-cross-entropy). Each chunk is one vocabulary pass: the matmul,
log_softmax in float32, the gather, and, when asked, exp and the entropy sum; the backward is
one more, with the two matmuls for the hidden states' and the head's gradients.

Precision: the matmul runs in the compute dtype (autocast's when enabled, else the weight's), as
`lm_head` would; the softmax in float32; the head's gradient accumulates over chunks in float32.

Compiling: `set_compile(True)` runs each chunk's forward and backward through torch.compile,
which fuses the softmax, the gather and the entropy into one loop over the vocabulary (the
trainer's `trainer.compile`; on by default on CUDA); a failure to compile falls back to eager.

Entropy: `entropy="none"` skips it, `"metric"` computes it without a graph (no backward work),
`"grad"` makes it differentiable (the entropy bonus): dH/dz = -p (log p + H).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from rollmesh.runtime.log import get_logger

__all__ = ["head_logprobs", "default_chunk", "set_compile"]

log = get_logger("rollmesh.algorithms.head")

EntropyMode = Literal["none", "metric", "grad"]


def default_chunk(vocab: int) -> int:
    """Rows per chunk: about 256 MiB of float32 logits (441 rows at Qwen's 151,936). Each
    chunk writes a whole [V, H] gradient of the head's weight, so fewer, taller chunks cost
    less (measured on CPU at 0.5B's shape, 408 rows: 3.1 s in chunks of 110, 2.5 s of 441)."""
    return max(32, min(8192, (1 << 26) // max(vocab, 1)))


def _compute_dtype(device: torch.device, weight: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


def _chunk_z(h: Tensor, w: Tensor, b: Tensor | None, temperature: float,
             softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """One chunk's z, float32 [c, V], and tanh(x / c) when soft-capped (for the backward)."""
    logits = h @ w.t()
    if b is not None:
        logits = logits + b
    z = logits.float()
    capped = None
    if softcap:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, capped


def _chunk_log_p(h: Tensor, w: Tensor, b: Tensor | None, temperature: float,
                 softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """(log softmax of one chunk's z, float32 [c, V]; tanh(x / c) when soft-capped)."""
    z, capped = _chunk_z(h, w, b, temperature, softcap)
    return torch.log_softmax(z, dim=-1), capped


def _chunk_probs(h: Tensor, w: Tensor, b: Tensor | None, temperature: float,
                 softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """softmax of one chunk's z, float32 [c, V], and tanh(x / c) when soft-capped."""
    z, capped = _chunk_z(h, w, b, temperature, softcap)
    return torch.softmax(z, dim=-1), capped


def _forward_chunk(h: Tensor, w: Tensor, b: Tensor | None, targets: Tensor, temperature: float,
                   softcap: float | None, want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk's log-probs [c] and entropy [c] (None unless asked), float32."""
    log_p, _ = _chunk_log_p(h, w, b, temperature, softcap)
    logp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(dim=-1) if want_entropy else None
    return logp, ent


def _backward_chunk(h: Tensor, w: Tensor, b: Tensor | None, targets: Tensor, grad_logp: Tensor,
                    grad_ent: Tensor | None, ent: Tensor | None, temperature: float,
                    softcap: float | None) -> Tensor:
    """The gradient with respect to one chunk's logits [c, V], float32."""
    g = grad_logp[:, None].float()
    if grad_ent is None:  # softmax alone: two passes over the chunk, in place
        p, capped = _chunk_probs(h, w, b, temperature, softcap)
        gz = p.mul_(-g).scatter_add_(-1, targets[:, None], g)
    else:
        log_p, capped = _chunk_log_p(h, w, b, temperature, softcap)
        p = log_p.exp()
        gz = (-g * p).scatter_add_(-1, targets[:, None], g)
        gz -= grad_ent[:, None].float() * p * (log_p + ent[:, None])
    if temperature != 1.0:
        gz = gz / temperature
    if capped is not None:
        gz = gz * (1 - capped * capped)
    return gz


# The chunk functions as run: eager, or compiled by `set_compile(True)` (one fused loop over
# the vocabulary per chunk instead of a kernel per operation), falling back to eager for good
# if compiling fails.
_impl: dict[str, Callable] = {"forward": _forward_chunk, "backward": _backward_chunk}


def set_compile(on: bool) -> None:
    """Run the chunk functions through torch.compile (on) or eagerly (off)."""
    if not on:
        _impl.update(forward=_forward_chunk, backward=_backward_chunk)
        return
    _impl.update(forward=_compiled(_forward_chunk, "forward"),
                 backward=_compiled(_backward_chunk, "backward"))


def _compiled(fn: Callable, name: str) -> Callable:
    compiled = torch.compile(fn, dynamic=None)
    eager = {"forward": _forward_chunk, "backward": _backward_chunk}[name]

    def run(*args):
        try:
            return compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compiler missing or failing: eager is right
            log.warning("head_compile_failed", part=name, error=repr(e)[:300],
                        fallback="eager")
            _impl[name] = eager
            return eager(*args)
    return run


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                temperature: float, softcap: float | None, chunk: int,
                entropy: str) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(hidden.device, weight)
        m = hidden.shape[0]
        logp = hidden.new_empty(m, dtype=torch.float32)
        ent = hidden.new_zeros(m if entropy != "none" else 0, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            forward = _impl["forward"]
            for s in range(0, m, chunk):
                e = min(s + chunk, m)
                lp, h_ent = forward(hidden[s:e].to(dtype), w, b, targets[s:e], temperature,
                                    softcap, entropy != "none")
                logp[s:e] = lp
                if h_ent is not None:
                    ent[s:e] = h_ent
        ctx.save_for_backward(hidden, weight, bias, targets, ent)
        ctx.settings = (temperature, softcap, chunk, entropy == "grad", dtype)
        if entropy != "grad":
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_ent: Tensor | None):
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        temperature, softcap, chunk, entropy_grad, dtype = ctx.settings
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = None  # the first chunk's product, then accumulated (no zero-filled start)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if want_b and bias is not None else None
        use_ent = entropy_grad and grad_ent is not None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            backward = _impl["backward"]
            for s in range(0, hidden.shape[0], chunk):
                e = min(s + chunk, hidden.shape[0])
                h = hidden[s:e].to(dtype)
                gz = backward(h, w, b, targets[s:e], grad_logp[s:e],
                              grad_ent[s:e] if use_ent else None,
                              ent[s:e] if use_ent else None, temperature, softcap)
                gl = gz.to(dtype)
                if grad_h is not None:
                    grad_h[s:e] = (gl @ w).to(hidden.dtype)
                if want_w:
                    if grad_w is None:
                        grad_w = (gl.t() @ h).float()
                    elif gl.dtype == torch.float32:
                        grad_w.addmm_(gl.t(), h)  # in place: no [V, H] temporary per chunk
                    else:
                        grad_w += (gl.t() @ h).float()
                if grad_b is not None:
                    grad_b += gz.sum(dim=0)
        if want_w and grad_w is None:  # no rows: a zero gradient all the same (every FSDP
            grad_w = torch.zeros(weight.shape, dtype=torch.float32,  # rank reduces the same)
                                 device=weight.device)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                  temperature: float = 1.0, softcap: float | None = None,
                  entropy: EntropyMode = "none", chunk: int | None = None,
                  ) -> tuple[Tensor, Tensor | None]:
    """(log p(targets) [M], entropy [M] or None) for hidden states [M, H] under the LM head
    `weight` [V, H] (and `bias` [V]); float32 results. See the module docstring."""
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if entropy not in ("none", "metric", "grad"):
        raise ValueError(f"entropy: expected 'none', 'metric' or 'grad', got {entropy!r}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [M, H] and targets [M], got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    chunk = chunk or default_chunk(weight.shape[0])
    logp, ent = _HeadLogprobs.apply(hidden, weight, bias, targets.long(), float(temperature),
                                    softcap, int(chunk), entropy)
    return logp, (ent if entropy != "none" else None)
