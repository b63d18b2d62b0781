"""The built-in engine's fast decode path: a slot KV cache and one decode step for the
Llama/Qwen family (Llama-3.x, Qwen2/2.5, Qwen3), sampling included.

`SlotKV` preallocates, per layer, keys and values `[slots + 1, kv_heads, capacity, head_dim]`:
a request takes a free slot when it joins the batch (its prefilled KV copied in) and gives it
back when it leaves; nobody else's rows move, nothing is concatenated. The last slot is the
spare the padded rows of a batch bucket write into. Both dimensions grow by doubling when
needed (rare: it re-allocates and copies, and drops captured graphs).

`FastDecoder.step` runs one token for every running row: embedding, per layer RMSNorm, fused
QKV (+bias), Qwen3's q/k norms, RoPE from a table (built by the model's own rotary module, so
every rope_scaling variant is exact), k/v written in place at each slot's position, SDPA over
each slot's length (GQA), fused gate/up MLP; final norm, lm_head, then the sampler (greedy,
temperature, top-k/top-p/min-p by the same inverse-CDF rule as sampling.py, uniforms drawn
from the engine's shared generator) and the chosen token's log-prob: one function of static
shapes per (batch bucket, attention window, sampling mode). On CUDA each is captured as a CUDA
graph; its (tokens, log-probs) come back by one non-blocking copy into pinned host memory.

The fused QKV and gate/up weights are copies: `FastDecoder.refresh` rebuilds them whenever the
model's parameters changed (the scheduler marks them stale on every weight load, and a
fingerprint of the source tensors' storage and version counters catches any other change), in
place when the shapes allow so captured graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rollmesh.engine.builtin.sampling import GREEDY_EPS
from rollmesh.runtime.log import get_logger

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
MIN_WINDOW = 16  # smallest attention window bucket (positions)
GREEDY, SAMPLE, FILTER = 0, 1, 2  # sampling modes, each its own static step


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot take the fast path (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one of {SUPPORTED_TYPES}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"layer types {sorted(types)}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind_of_rope = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind_of_rope in ("dynamic", "longrope"):
        # Their frequencies follow the sequence's current length: no fixed table is exact.
        return f"rope_type {kind_of_rope!r}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not the Llama/Qwen module layout (model.model.layers, rotary_emb)"
    attn = inner.layers[0].self_attn
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention without q/k/v/o projections"
    mlp = inner.layers[0].mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "MLP without gate/up/down projections"
    return None


class SlotKV:
    """Per-layer K/V slots; slot `slots` (the last) is the spare padded rows write into."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int, capacity: int) -> None:
        self.shape = (kv_heads, head_dim)
        self.layers, self.dtype, self.device = layers, dtype, device
        self.slots, self.capacity = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.free: list[int] = []
        self.generation = 0  # bumped on every re-allocation (captured graphs hold the old ones)
        self._grow(max(1, slots), max(MIN_WINDOW, capacity))

    @property
    def spare(self) -> int:
        return self.slots

    def _grow(self, slots: int, capacity: int) -> None:
        kvh, d = self.shape
        k = [torch.zeros(slots + 1, kvh, capacity, d, dtype=self.dtype, device=self.device)
             for _ in range(self.layers)]
        v = [torch.zeros_like(t) for t in k]
        for old, new in ((self.k, k), (self.v, v)):
            for a, b in zip(old, new):
                b[: self.slots, :, : self.capacity] = a[: self.slots]
        self.free = sorted(set(self.free) | set(range(self.slots, slots)), reverse=True)
        self.k, self.v, self.slots, self.capacity = k, v, slots, capacity
        self.generation += 1

    def ensure(self, length: int) -> None:
        """Room for `length` positions in every slot."""
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._grow(self.slots, cap)

    def take(self) -> int:
        if not self.free:
            self._grow(self.slots * 2, self.capacity)
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def write(self, slot: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]],
              length: int) -> None:
        """Copy a prompt's KV (per layer [kv_heads, >= length, dim], its last `length`
        positions) into `slot`'s first positions."""
        self.ensure(length + 1)
        for i, (k, v) in enumerate(layer_kv):
            self.k[i][slot, :, :length] = k[:, k.shape[1] - length :]
            self.v[i][slot, :, :length] = v[:, v.shape[1] - length :]


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm: tuple[torch.Tensor, float] | None  # Qwen3: q_norm per q head, k_norm per k head
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: Any


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm, operation for operation (greedy output must match generate exactly).
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _eps(norm: Any) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _bias(*linears: Any) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else lin.weight.new_zeros(lin.weight.shape[0])
                      for b, lin in zip(biases, linears)])


class FastDecoder:
    def __init__(self, model: Any, *, slots: int, graphs: bool | None = None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast decode path does not support this model: {reason}")
        self.model = model
        self.inner = model.model
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = self.inner.embed_tokens.weight.dtype
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.scale = self.head_dim ** -0.5
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 20))
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        # Static shapes (batch padded to a bucket, power-of-two windows): what graphs need;
        # eager steps run exact shapes unless told otherwise (a test comparing the two).
        self.buckets = self.graphs
        self.log = get_logger("rollmesh.engine.builtin.decoder")
        self.kv = SlotKV(len(self.inner.layers), self.kv_heads, self.head_dim, self.dtype,
                         self.device, slots, 256)
        self.layers: list[_Layer] = []
        self.stale = True
        self._fingerprint: tuple = ()
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self._graphs: dict[tuple, tuple[Any, list[torch.Tensor], tuple]] = {}
        self._graph_generation = -1
        self._pool = None
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None
        self.refresh()

    # ---- weights ----
    def _sources(self) -> list[torch.Tensor]:
        out = []
        for layer in self.inner.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                    m.gate_proj.weight, m.up_proj.weight]
            out += [n.weight for n in (getattr(a, "q_norm", None), getattr(a, "k_norm", None))
                    if n is not None]
            out += [b for b in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
                                m.gate_proj.bias, m.up_proj.bias) if b is not None]
        return out

    def _current_fingerprint(self) -> tuple:
        marks = []
        for t in self._sources():
            try:
                version = t._version
            except RuntimeError:  # inference tensors keep no version counter
                version = -1
            marks.append((t.data_ptr(), version))
        return tuple(marks)

    def refresh(self, force: bool = False) -> bool:
        """Rebuild the fused weights if the model's changed; True if they were rebuilt."""
        marks = self._current_fingerprint()
        if not (force or self.stale or marks != self._fingerprint):
            return False
        old = self.layers
        layers = []
        with torch.no_grad():
            for i, layer in enumerate(self.inner.layers):
                a, m = layer.self_attn, layer.mlp
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
                qkv_bias = _bias(a.q_proj, a.k_proj, a.v_proj)
                gate_up_bias = _bias(m.gate_proj, m.up_proj)
                if i < len(old) and old[i].qkv.shape == qkv.shape:
                    # In place: a captured graph reads these very tensors.
                    qkv = old[i].qkv.copy_(qkv)
                    gate_up = old[i].gate_up.copy_(gate_up)
                    if qkv_bias is not None and old[i].qkv_bias is not None:
                        qkv_bias = old[i].qkv_bias.copy_(qkv_bias)
                    if gate_up_bias is not None and old[i].gate_up_bias is not None:
                        gate_up_bias = old[i].gate_up_bias.copy_(gate_up_bias)
                qk_norm = self._qk_norm(a)
                if qk_norm is not None and i < len(old) and old[i].qk_norm is not None:
                    qk_norm = (old[i].qk_norm[0].copy_(qk_norm[0]), qk_norm[1])
                layers.append(_Layer(
                    ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                    eps1=_eps(layer.input_layernorm), eps2=_eps(layer.post_attention_layernorm),
                    qkv=qkv, qkv_bias=qkv_bias,
                    qk_norm=qk_norm,
                    o=a.o_proj.weight, o_bias=a.o_proj.bias,
                    gate_up=gate_up, gate_up_bias=gate_up_bias,
                    down=m.down_proj.weight, down_bias=m.down_proj.bias, act=m.act_fn))
        # Any storage that moved (a parameter replaced, not copied into) voids captured graphs.
        if [m[0] for m in marks] != [m[0] for m in self._fingerprint]:
            self._graphs.clear()
        self.layers = layers
        self._fingerprint = self._current_fingerprint()
        self.stale = False
        return True

    def release_memory(self) -> None:
        """Drop what this decoder holds beyond the model (fused copies, captured graphs, the
        RoPE table, and the slot cache when no request holds a slot): for an engine that gives
        its GPU memory back between rollouts. The next step rebuilds them."""
        self.layers, self.stale, self._fingerprint = [], True, ()
        self._graphs.clear()
        self._pool = None
        self._rope_len, self._cos, self._sin = 0, torch.empty(0), torch.empty(0)
        kv = self.kv
        if len(kv.free) == kv.slots:
            kv.slots, kv.capacity, kv.k, kv.v, kv.free = 0, 0, [], [], []
            kv._grow(1, MIN_WINDOW)

    def _qk_norm(self, attn: Any) -> tuple[torch.Tensor, float] | None:
        # One norm (and one rotation) over the q and k heads together: a [heads + kv_heads,
        # head_dim] weight, element for element what HF's two norms compute.
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if qn is None and kn is None:
            return None
        if qn is None or kn is None or _eps(qn) != _eps(kn):
            raise ValueError("the fast decode path needs both q_norm and k_norm, of equal eps")
        weight = torch.cat([qn.weight.expand(self.heads, -1), kn.weight.expand(self.kv_heads, -1)])
        return weight, _eps(qn)

    def _rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        n = min(max(length, 2 * self._rope_len, 256), max(self.max_positions, length))
        positions = torch.arange(n, device=self.device)[None, :]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, positions)
        self._cos, self._sin, self._rope_len = cos[0], sin[0], n
        self._graphs.clear()

    # ---- the step (static shapes; what a graph captures / torch.compile traces) ----
    def forward_step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, u: torch.Tensor, window: int, mode: int,
                     in_order: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token for each row: (next tokens, their log-probs, the logits). in_order: row r
        holds slot r (then attention reads the slots in place, no gather)."""
        b = tokens.shape[0]
        x = self.inner.embed_tokens(tokens)
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]
        # Row r attends to its slot's positions 0..positions[r] (the new one included).
        mask = (torch.arange(window, device=tokens.device)[None, :]
                <= positions[:, None])[:, None, None, :]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, layer.eps1)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            qk = qkv[:, : q_size + kv_size].view(b, self.heads + self.kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size :].view(b, self.kv_heads, self.head_dim)
            if layer.qk_norm is not None:
                qk = _rms(qk, *layer.qk_norm)
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            kc, vc = self.kv.k[i], self.kv.v[i]
            kc[slots, :, positions] = k
            vc[slots, :, positions] = v
            if in_order:
                keys, values = kc[:b, :, :window], vc[:b, :, :window]
            else:
                keys = kc[:, :, :window].index_select(0, slots)
                values = vc[:, :, :window].index_select(0, slots)
            att = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask,
                                                 scale=self.scale,
                                                 enable_gqa=self.heads != self.kv_heads)
            x = x + F.linear(att.reshape(b, q_size), layer.o, layer.o_bias)
            h = _rms(x, layer.ln2, layer.eps2)
            gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(layer.act(gate) * up, layer.down, layer.down_bias)
        x = _rms(x, self.inner.norm.weight, _eps(self.inner.norm))
        head = self.model.lm_head
        logits = F.linear(x, head.weight, head.bias).float()
        greedy = temps < GREEDY_EPS
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        chosen = logprobs.argmax(dim=-1)
        if mode != GREEDY:
            pool = _filter(scaled, top_k, top_p, min_p) if mode == FILTER else scaled
            cdf = torch.log_softmax(pool, dim=-1).exp().cumsum(dim=-1, dtype=torch.float64)
            drawn = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
            drawn = drawn.clamp(max=logits.shape[-1] - 1)
            chosen = torch.where(greedy, chosen, drawn)
        return chosen, logprobs.gather(1, chosen[:, None])[:, 0], logits

    # ---- one step for the scheduler ----
    def bucket(self, rows: int) -> int:
        if not self.buckets:
            return rows  # eager: no padding needed
        b = 1
        while b < rows:
            b *= 2
        return b

    def step(self, slots: list[int], tokens: list[int], positions: list[int],
             temps: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
             generator: torch.Generator) -> tuple[list[int], list[float], torch.Tensor]:
        """Decode one token for each row; positions[r] is where its new token goes (the
        tokens its slot holds). Returns host (tokens, log-probs) and the device logits."""
        self.refresh()
        rows = len(slots)
        top = max(positions) + 1
        self.kv.ensure(top)
        self._rope(top)
        # A graph per window: windows in powers of two; eager: exactly the positions in use.
        window = (min(self.kv.capacity, max(MIN_WINDOW, 1 << (top - 1).bit_length()))
                  if self.buckets else top)
        greedy = all(t < GREEDY_EPS for t in temps)
        mode = GREEDY if greedy else (FILTER if any(
            t >= GREEDY_EPS and (k > 0 or p < 1.0 or m > 0.0)
            for t, k, p, m in zip(temps, top_k, top_p, min_p)) else SAMPLE)
        b = self.bucket(rows)
        pad = b - rows
        in_order = pad == 0 and slots == list(range(rows))
        vocab = self.model.lm_head.weight.shape[0]
        ints = torch.tensor([tokens + [0] * pad, positions + [0] * pad,
                             slots + [self.kv.spare] * pad,
                             [k if k > 0 else vocab for k in top_k] + [vocab] * pad])
        floats = torch.tensor([temps + [0.0] * pad, top_p + [1.0] * pad, min_p + [0.0] * pad],
                              dtype=torch.float32)
        if self.device.type == "cuda":
            ints, floats = ints.pin_memory(), floats.pin_memory()
        ints = ints.to(self.device, non_blocking=True)
        floats = floats.to(self.device, non_blocking=True)
        u = (torch.rand(b, generator=generator, device=self.device, dtype=torch.float64)
             if mode != GREEDY else torch.zeros(b, device=self.device, dtype=torch.float64))
        args = [ints[0], ints[1], ints[2], floats[0], ints[3], floats[1], floats[2], u]
        if self.graphs:
            chosen, logprobs, logits = self._replay((b, window, mode, in_order), args)
        else:
            chosen, logprobs, logits = self.forward_step(*args, window, mode, in_order)
        return (*self._to_host(chosen[:rows], logprobs[:rows]), logits[:rows])

    def _to_host(self, tokens: torch.Tensor, logprobs: torch.Tensor
                 ) -> tuple[list[int], list[float]]:
        if self.device.type != "cuda":
            return tokens.tolist(), logprobs.tolist()
        n = tokens.shape[0]
        if self._host is None or self._host[0].shape[0] < n:
            size = max(n, 64)
            self._host = (torch.empty(size, dtype=torch.int64, pin_memory=True),
                          torch.empty(size, dtype=torch.float32, pin_memory=True))
        host_t, host_l = self._host[0][:n], self._host[1][:n]
        host_t.copy_(tokens, non_blocking=True)
        host_l.copy_(logprobs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the step's one host sync: the scheduler needs the tokens
        return host_t.tolist(), host_l.tolist()

    def _replay(self, key: tuple, args: list[torch.Tensor]) -> tuple:
        if self._graph_generation != self.kv.generation:
            self._graphs.clear()  # the slot tensors were re-allocated
            self._graph_generation = self.kv.generation
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, args)
            self._graphs[key] = entry
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, args):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out

    def _capture(self, key: tuple, args: list[torch.Tensor]) -> tuple:
        _, window, mode, in_order = key
        static_in = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Warm-up (allocator, kernels' workspaces): it writes the same k/v the replay will.
            for _ in range(2):
                self.forward_step(*static_in, window, mode, in_order)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = self.forward_step(*static_in, window, mode, in_order)
        self.log.info("decode_graph_captured", batch=key[0], window=window, mode=mode,
                      in_order=in_order, graphs=len(self._graphs) + 1)
        return graph, static_in, static_out


class SlotBatch:
    """The running batch's KV for the fast path (BatchKV's interface): row r of the
    scheduler's running list owns slot `slots[r]`."""

    def __init__(self, kv: SlotKV) -> None:
        self.kv = kv
        self.slots: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.slots)

    def clear(self) -> None:
        for s in self.slots:
            self.kv.release(s)
        self.slots = []

    def merge(self, cache: Any, lengths: list[int]) -> None:
        """Rows of a freshly prefilled (right-aligned) cache join: each takes a slot."""
        for row, length in enumerate(lengths):
            slot = self.kv.take()
            self.kv.write(slot, [(layer.keys[row], layer.values[row])
                                 for layer in cache.layers], length)
            self.slots.append(slot)

    def select(self, keep: list[int], lengths: list[int]) -> None:
        kept = set(keep)
        for r, s in enumerate(self.slots):
            if r not in kept:
                self.kv.release(s)
        self.slots = [self.slots[r] for r in keep]


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor) -> torch.Tensor:
    """sampling._filter with the row parameters as tensors (top_k: vocab for none)."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)
    remove = ranks[None, :] >= top_k[:, None]
    probs = torch.softmax(values.masked_fill(remove, float("-inf")), dim=-1)
    remove = remove | ((probs.cumsum(dim=-1) - probs) > top_p[:, None])
    remove = remove | (probs < min_p[:, None] * probs[:, :1])
    mask = torch.empty_like(remove).scatter(1, order, remove)
    return scaled.masked_fill(mask, float("-inf"))
