"""The running batch's KV cache: one left-padded tensor pair per layer, rows right-aligned.

Row r holds its `length_r` tokens in the last `length_r` slots; the slots before are zero
padding, masked out by the decode step's attention mask. Requests join (`merge`) and leave
(`select`) between decode steps; `select` also drops padding columns no row needs any more, so a
batch never carries the history of a request that left.

It wraps a transformers DynamicCache (the model appends each step's keys and values itself) and
reaches into its layers' `keys`/`values`: the one place that knows that layout. (Layers that
kept spare columns to append in place instead of concatenating measured no faster on CPU.)

`PrefixCache`: prompt KV kept across requests (a radix tree keyed on token ids), so that a
prompt seen before (a GRPO group's other samples) is not prefilled again; `past_cache` builds
the past a prefill of the rest of the prompts runs on.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class UnsupportedModel(RuntimeError):
    """A model whose cache is not a plain per-layer key/value cache (e.g. recurrent layers)."""


def new_cache() -> DynamicCache:
    # No config on purpose: plain full-length layers for every model. A sliding-window model is
    # still right (its mask applies the window), it just keeps more history than it needs.
    return DynamicCache()


def _check(cache: DynamicCache) -> None:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise UnsupportedModel(
                "the built-in engine supports plain attention caches only, got "
                f"{type(layer).__name__}"
            )


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Rows `index` of a freshly prefilled cache, in that order (repeats copy a row: the n
    samples of one prompt)."""
    _check(cache)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


class BatchKV:
    def __init__(self) -> None:
        self.cache: DynamicCache | None = None

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else self.cache.layers[0].keys.shape[0]

    @property
    def seq_len(self) -> int:
        return 0 if self.cache is None else self.cache.layers[0].keys.shape[-2]

    def clear(self) -> None:
        self.cache = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self.cache.layers:
            layer.keys = fn(layer.keys)
            layer.values = fn(layer.values)

    def merge(self, other: DynamicCache) -> None:
        """Append the rows of a freshly prefilled cache (right-aligned) below the batch's rows."""
        _check(other)
        if self.cache is None:
            self.cache = other
            return
        t, t_other = self.seq_len, other.layers[0].keys.shape[-2]
        if t_other < t:
            for layer in other.layers:
                layer.keys = F.pad(layer.keys, (0, 0, t - t_other, 0))
                layer.values = F.pad(layer.values, (0, 0, t - t_other, 0))
        elif t_other > t:
            self._map(lambda x: F.pad(x, (0, 0, t_other - t, 0)))
        for mine, theirs in zip(self.cache.layers, other.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)

    def select(self, keep: list[int], lengths: list[int]) -> None:
        """Keep rows `keep` (whose lengths are `lengths`), then drop padding nobody needs."""
        if not keep:
            self.cache = None
            return
        if len(keep) < self.rows:
            index = torch.tensor(keep, device=self.cache.layers[0].keys.device)
            self._map(lambda x: x.index_select(0, index))
        drop = self.seq_len - max(lengths)
        if drop > 0:
            self._map(lambda x: x[:, :, drop:, :])


# ---- prompt prefixes shared across requests ----
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [kv_heads, tokens, dim]


def row_kv(cache: DynamicCache, row: int, length: int) -> KV:
    """Row `row`'s last `length` positions of a prefilled cache (views, no copy)."""
    return [(layer.keys[row, :, -length:], layer.values[row, :, -length:])
            for layer in cache.layers]


def past_cache(prefixes: list[KV | None], lengths: list[int]) -> DynamicCache:
    """A cache holding each row's cached prompt prefix, rows right-aligned (left padding, as the
    batch): the past a prefill of the prompts' remaining tokens runs on."""
    width = max(lengths)
    template = next(kv for kv in prefixes if kv is not None)
    layers = []
    for i, (k0, v0) in enumerate(template):
        shape = (len(prefixes), k0.shape[0], width, k0.shape[-1])
        keys = k0.new_zeros(shape)
        values = v0.new_zeros((*shape[:-1], v0.shape[-1]))
        for row, (kv, n) in enumerate(zip(prefixes, lengths)):
            if n:
                keys[row, :, width - n :] = kv[i][0]
                values[row, :, width - n :] = kv[i][1]
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used")

    def __init__(self, tokens: tuple[int, ...], kv: KV, parent: _Node | None, used: int) -> None:
        self.tokens = tokens  # the token ids of the edge into this node
        self.kv = kv  # their KV, per layer, stored once
        self.children: dict[int, _Node] = {}  # by their first token
        self.parent = parent
        self.last_used = used


def _common(edge: tuple[int, ...], ids: list[int], start: int, end: int) -> int:
    n = min(len(edge), end - start)
    for i in range(n):
        if edge[i] != ids[start + i]:
            return i
    return n


class PrefixCache:
    """Prompt KV shared across requests, keyed on token ids: a radix tree (SGLang's radix cache,
    on this engine's tensors).

    Each node holds the KV of its edge's tokens once, however many prompts pass through it (a
    chat template's system prompt, a GRPO group's question), so `tokens` counts every cached
    token once. `match` hands out the KV of the longest cached prefix; the requests that use it
    copy it into their batch rows (the batch is one dense tensor per layer, concatenated anew
    at every decode step: there are no blocks to share in place), so nothing in the tree is
    pinned by a running request and any node may go at any time: past `max_tokens` the least
    recently used leaves are evicted first. A tensor handed out stays valid after its node is
    evicted (it is freed when its last user drops it).

    KV depends on the weights: the owner clears the tree whenever they change.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0
        self.evicted_tokens = 0
        self._clock = 0
        self.root = _Node((), [], None, 0)

    def clear(self) -> None:
        self.root = _Node((), [], None, 0)
        self.tokens = 0

    def match(self, ids: list[int], limit: int) -> tuple[int, KV | None]:
        """(n, kv): the longest cached prefix of `ids[:limit]`, n tokens, and their KV."""
        self._clock += 1
        node, pos, parts = self.root, 0, []
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common(child.tokens, ids, pos, limit)
            child.last_used = self._clock
            parts.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        if not pos:
            return 0, None
        if len(parts) == 1:
            child, n = parts[0]
            return pos, [(k[:, :n], v[:, :n]) for k, v in child.kv]
        return pos, [(torch.cat([c.kv[i][0][:, :n] for c, n in parts], dim=1),
                      torch.cat([c.kv[i][1][:, :n] for c, n in parts], dim=1))
                     for i in range(len(parts[0][0].kv))]

    def insert(self, ids: list[int], kv: KV) -> None:
        """Cache the prompt `ids` whose KV (per layer [kv_heads, len(ids), dim]) is `kv`: only
        the tokens not cached yet are stored (copied, so the caller's tensors can go)."""
        if len(ids) > self.max_tokens:
            return
        self._clock += 1
        node, pos, end = self.root, 0, len(ids)
        while pos < end:
            child = node.children.get(ids[pos])
            if child is None:
                node.children[ids[pos]] = _Node(
                    tuple(ids[pos:]), [(k[:, pos:].clone(), v[:, pos:].clone()) for k, v in kv],
                    node, self._clock)
                self.tokens += end - pos
                break
            n = _common(child.tokens, ids, pos, end)
            if pos + n < end and n < len(child.tokens):
                self._split(child, n)  # the rest keeps its own last use
            child.last_used = self._clock
            if pos + n == end:
                break  # all of it is cached already
            node, pos = child, pos + n
        self._evict()

    @staticmethod
    def _split(node: _Node, n: int) -> None:
        """Cut `node`'s edge after n tokens: the rest becomes its only child. (Copies, so that
        each half's memory goes when its node does.)"""
        rest = _Node(node.tokens[n:], [(k[:, n:].clone(), v[:, n:].clone()) for k, v in node.kv],
                     node, node.last_used)
        rest.children = node.children
        for c in rest.children.values():
            c.parent = rest
        node.tokens = node.tokens[:n]
        node.kv = [(k[:, :n].clone(), v[:, :n].clone()) for k, v in node.kv]
        node.children = {rest.tokens[0]: rest}

    def _evict(self) -> None:
        if self.tokens <= self.max_tokens:
            return
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                heapq.heappush(leaves, (node.last_used, id(node), node))
        while self.tokens > self.max_tokens and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[node.tokens[0]]
            self.tokens -= len(node.tokens)
            self.evicted_tokens += len(node.tokens)
            if not parent.children and parent is not self.root:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
