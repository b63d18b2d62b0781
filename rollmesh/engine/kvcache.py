"""The running batch's KV cache: one left-padded tensor pair per layer, rows right-aligned.

Row r holds its `length_r` tokens in the last `length_r` slots; the slots before are zero
padding, masked out by the decode step's attention mask. Requests join (`merge`) and leave
(`select`) between decode steps; `select` also drops padding columns no row needs any more, so a
batch never carries the history of a request that left.

It wraps a transformers DynamicCache (the model appends each step's keys and values itself) and
reaches into its layers' `keys`/`values`: the one place that knows that layout. (Layers that
kept spare columns to append in place instead of concatenating measured no faster on CPU.)
"""

from __future__ import annotations

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
        """Append the rows of a freshly prefilled cache (no padding) below the batch's rows."""
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
