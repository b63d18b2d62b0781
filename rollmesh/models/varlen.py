"""Attention over packed sequences: several sequences in one row, each attending only to itself.

The trainer packs a micro-batch into one row of N real tokens (no padding), with position ids
restarting at each sequence and the boundaries as cumulative lengths `cu_seq_lens` [S + 1]
(what flash attention's varlen kernels take). `use_packed_attention(model, device)` switches a
transformers model to a kernel for such rows, chosen per device:

    flash_attention_2   CUDA with the flash-attn package installed: transformers' own varlen
                        path (it reads `cu_seq_lens_q/k` and `max_length_q/k`);
    rollmesh_varlen     everything else, registered with transformers' AttentionInterface under
                        that name; per call it runs one of
        torch varlen    CUDA: `torch.nn.attention.varlen.varlen_attn` (flash, no mask), when a
                        probe at first use matches the loop below, values and gradients, to
                        5e-2 (bf16) / 1e-4 (float32);
        per sequence    scaled_dot_product_attention(is_causal=True) on each sequence's slice
                        (on CPU this is torch's flash kernel: no N x N mask, no padding, the
                        attention FLOPs are those of the sequences alone);
        eager           per sequence, scores materialised: attention logit soft-capping
                        (Gemma2), or a sliding window the kernels above do not take.

`rollmesh_varlen` has no mask function registered, so transformers builds no [N, N] mask for
it. The function never reads the attention mask: a packed row has none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from rollmesh.runtime.log import get_logger

log = get_logger("rollmesh.models.varlen")

NAME = "rollmesh_varlen"
_registered = False
_torch_varlen_ok: dict[str, bool] = {}


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """[B, Hkv, N, D] -> [B, H, N, D] (grouped-query attention)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _eager_one(q: Tensor, k: Tensor, v: Tensor, scaling: float, softcap: float | None,
               window: int | None) -> Tensor:
    """One sequence, [1, H, L, D] each (k, v expanded): causal, optional soft-cap and window."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[-2]
    i = torch.arange(n, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window:
        allowed &= (i[:, None] - i[None, :]) < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _per_sequence(q: Tensor, k: Tensor, v: Tensor, segments: list[tuple[int, int]],
                  scaling: float, softcap: float | None, window: int | None) -> Tensor:
    """Each sequence's causal attention on its own slice. The row is split (one op, whose
    backward is one concatenation) rather than sliced per sequence (whose backward would write
    each slice's gradient into a zero tensor of the whole row)."""
    heads = q.shape[1]
    gqa = k.shape[1] != heads  # SDPA takes fewer key/value heads as they are
    sizes = [e - s for s, e in segments]
    if len(sizes) == 1:
        parts = [(q, k, v)]
    else:
        if sum(sizes) != q.shape[2]:
            raise ValueError(f"rollmesh_varlen: segments cover {sum(sizes)} of "
                             f"{q.shape[2]} positions")
        parts = list(zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)))
    outs = []
    for (qs, ks, vs), n in zip(parts, sizes):
        if softcap or (window and n > window):
            outs.append(_eager_one(qs, _expand_kv(ks, heads), _expand_kv(vs, heads), scaling,
                                   softcap, window))
        else:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                                       enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _torch_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int,
                  scaling: float) -> Tensor:
    """torch's flash varlen kernel: [1, H, N, D] in, [1, H, N, D] out."""
    from torch.nn.attention.varlen import varlen_attn

    heads = q.shape[1]
    qt = q[0].transpose(0, 1)
    kt = _expand_kv(k, heads)[0].transpose(0, 1)
    vt = _expand_kv(v, heads)[0].transpose(0, 1)
    cu32 = cu.to(device=q.device, dtype=torch.int32)
    try:  # torch >= 2.12 takes a window, (-1, 0) = causal
        out = varlen_attn(qt, kt, vt, cu32, cu32, max_len, max_len, scale=scaling,
                          window_size=(-1, 0))
    except TypeError:  # earlier releases: is_causal
        out = varlen_attn(qt, kt, vt, cu32, cu32, max_len, max_len, is_causal=True,
                          scale=scaling)
    return out.transpose(0, 1)[None]


def _torch_varlen_usable(q: Tensor) -> bool:
    """Whether torch's varlen kernel runs here, forward and backward, and matches the
    per-sequence loop (probed once per device and dtype, on a small random case)."""
    key = f"{q.device}:{q.dtype}"
    if key not in _torch_varlen_ok:
        ok = False
        try:
            with torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
                g = torch.Generator(device=q.device).manual_seed(0)
                shapes = ((1, 4, 24, q.shape[-1]), (1, 2, 24, q.shape[-1]),
                          (1, 2, 24, q.shape[-1]))
                qq, kk, vv = (torch.randn(s, device=q.device, dtype=q.dtype, generator=g)
                              .requires_grad_() for s in shapes)
                scale = q.shape[-1] ** -0.5
                got = _torch_varlen(qq, kk, vv, torch.tensor([0, 10, 24]), 14, scale)
                got_grads = torch.autograd.grad(got.float().square().sum(), (qq, kk, vv))
                want = _per_sequence(qq, kk, vv, [(0, 10), (10, 24)], scale, None, None)
                want_grads = torch.autograd.grad(want.float().square().sum(), (qq, kk, vv))
            tol = 1e-4 if q.dtype == torch.float32 else 5e-2
            ok = all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
                     for a, b in zip((got, *got_grads), (want, *want_grads)))
        except Exception as e:  # noqa: BLE001 - any failure means: not here
            log.info("torch_varlen_unavailable", device=str(q.device), reason=repr(e)[:200])
        _torch_varlen_ok[key] = ok
        log.info("packed_attention_kernel", device=str(q.device), dtype=str(q.dtype),
                 kernel="torch varlen" if ok else "per-sequence sdpa")
    return _torch_varlen_ok[key]


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs: Any,
                             ) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, H, N, D], key/value [B, Hkv, N, D];
    returns ([B, N, H, D], None).

    A packed row (B = 1) comes with `rollmesh_segments` (its sequences' (start, end), Python
    ints) and `cu_seq_lens_q` / `max_length_q` (the same bounds on the device), passed through
    the model's forward, and so also to a layer recomputed by activation checkpointing. Without
    them every row is one sequence, right-padded: causal attention never lets a real token see
    the padding after it, so no mask is needed (transformers builds none for this name)."""
    if dropout:
        raise ValueError("rollmesh_varlen: attention dropout is not supported in training")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    segments = kwargs.get("rollmesh_segments")
    if segments is None:
        segments = [(0, query.shape[2])]
    elif query.shape[0] != 1:
        raise ValueError("rollmesh_varlen: a packed batch is one row")
    cu = kwargs.get("cu_seq_lens_q")
    if (len(segments) > 1 and cu is not None and query.device.type == "cuda" and not softcap
            and not sliding_window and _torch_varlen_usable(query)):
        max_len = kwargs.get("max_length_q") or max(e - s for s, e in segments)
        out = _torch_varlen(query, key, value, cu, int(max_len), scaling)
    else:
        out = _per_sequence(query, key, value, segments, scaling, softcap, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `rollmesh_varlen` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, varlen_attention_forward)
        _registered = True


def kernel_for(model: torch.nn.Module, device: torch.device) -> str:
    """The attention implementation a packed row runs with on `device` (see the docstring)."""
    if device.type == "cuda" and not getattr(model.config, "attn_logit_softcapping", None):
        try:
            from transformers.utils import is_flash_attn_2_available
            if is_flash_attn_2_available():
                return "flash_attention_2"
        except ImportError:
            pass
    return NAME


def use_packed_attention(model: torch.nn.Module, device: torch.device) -> str:
    """Switch `model` (every sub-config) to the packed-row kernel for `device`, for good: a
    layer recomputed in the backward pass must run the same kernel. Returns its name."""
    register()
    name = kernel_for(model, device)
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
    return name


def packed_kwargs(segments: list[tuple[int, int]], device: torch.device) -> dict[str, Any]:
    """What a model's forward takes for one packed row, besides input_ids and position_ids."""
    bounds = [0] + [e for _, e in segments]
    cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
    longest = max((e - s for s, e in segments), default=0)
    return {"rollmesh_segments": segments, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest}
