"""Per-token log-probs and entropy from logits, in float32, chunked over tokens.

The vocabulary makes [B, T, V] logits the largest tensor of a step (16k tokens x 152k vocab is
4.9 GB in bf16). Both functions convert one chunk of rows to float32 at a time, and their
backward recomputes the softmax chunk by chunk, so neither the forward nor the autograd graph
ever holds a float32 copy of the whole logits tensor; the gradient has the logits' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["entropy_from_logits", "token_logprobs"]

DEFAULT_CHUNK_TOKENS = 1024


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _TokenLogprobs(torch.autograd.Function):
    """out = z[tok] - logsumexp(z), z = logits / temperature; d out/d logits = (onehot - p) / T."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk: int) -> Tensor:
        out = logits.new_empty(logits.shape[0], dtype=torch.float32)
        lse = torch.empty_like(out)
        for s, e in _chunks(logits.shape[0], chunk):
            z = logits[s:e].float() / temperature
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, tokens[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in _chunks(logits.shape[0], ctx.chunk):
            g = grad_out[s:e, None].float()
            p = torch.exp(logits[s:e].float() / ctx.temperature - lse[s:e, None])
            gz = (-g * p).scatter_add_(-1, tokens[s:e, None], g)
            grad[s:e] = gz / ctx.temperature
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H = -sum p log p; dH/dz_j = -p_j (log p_j + H), z = logits / temperature.

    Computed on z shifted by its row maximum: log p = (z - max) - lse(z - max) with both terms
    of order log(vocab), however large the logits. The unshifted form, lse(z) - sum p z, loses
    the rounding of lse(z) times sum p z: 1e-4 in H (and its gradient) at |z| ~ 60, 1e-3 at 245.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk: int) -> Tensor:
        entropy = logits.new_empty(logits.shape[0], dtype=torch.float32)
        top = torch.empty_like(entropy)
        lse = torch.empty_like(entropy)  # of the shifted row
        for s, e in _chunks(logits.shape[0], chunk):
            z = logits[s:e].float() / temperature
            top[s:e] = z.amax(dim=-1)
            log_p = _shifted_log_p(z, top[s:e], lse[s:e])
            p = log_p.exp()
            # p = 0 where z = -inf (a banned token): 0 * -inf would be NaN, the term is 0.
            entropy[s:e] = -torch.where(p > 0, p * log_p, 0.0).sum(dim=-1)
        ctx.save_for_backward(logits, top, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, top, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in _chunks(logits.shape[0], ctx.chunk):
            log_p = (logits[s:e].float() / ctx.temperature - top[s:e, None]) - lse[s:e, None]
            p = log_p.exp()
            gz = -grad_out[s:e, None].float() * p * (log_p + entropy[s:e, None])
            grad[s:e] = torch.where(p > 0, gz, 0.0) / ctx.temperature
        return grad, None, None


def _shifted_log_p(z: Tensor, top: Tensor, lse_out: Tensor) -> Tensor:
    """log softmax(z) as (z - max) - lse(z - max); writes lse(z - max) into `lse_out`."""
    shifted = z - top[:, None]
    lse_out.copy_(torch.logsumexp(shifted, dim=-1))
    return shifted - lse_out[:, None]


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, shift: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(logits / temperature) at the given tokens, float32 [B, T].

        out[b, t] = z[b, t', tokens[b, t]] - logsumexp_v z[b, t', v],   z = logits / temperature

    Alignment: the result is always aligned with `tokens`, so `mask` applies to it directly.
      shift=False: logits[b, t] already scores tokens[b, t] (t' = t; the caller shifted).
      shift=True:  logits[b, t] is the model output at position t, which predicts token t + 1
                   (t' = t - 1); out[:, 0] = 0, as the first token has no prediction.
    Temperature must be the engine's sampling temperature, or the log-probs do not match the
    behaviour log-probs. Works on [B, T, V] or [N, V] logits of any float dtype.
    """
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    tokens = tokens.long()
    if shift:
        # Position t scores token t + 1; the wrapped-around last column is dropped below.
        tokens = tokens.roll(-1, dims=-1)
    vocab = logits.shape[-1]
    flat = _TokenLogprobs.apply(
        logits.reshape(-1, vocab), tokens.reshape(-1), float(temperature), chunk_tokens
    )
    out = flat.reshape(tokens.shape)
    if shift:
        out = torch.cat([out.new_zeros(out.shape[:-1] + (1,)), out[..., :-1]], dim=-1)
    return out


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, float32, shape logits[..., 0].

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v,   z = logits / temperature

    Stable for any logit scale and for -inf logits (no log of a 0 probability).
    The entropy bonus is the caller's: loss - entropy_coef * aggregate(entropy, mask, agg).
    """
    vocab = logits.shape[-1]
    flat = _Entropy.apply(logits.reshape(-1, vocab), float(temperature), chunk_tokens)
    return flat.reshape(logits.shape[:-1])
