"""A trainer batch as tensors, and how its variable-length sequences are cut into work.

`BatchData` holds the whole batch right-padded to its longest sequence, token-aligned: column t
of every [B, T] tensor is about token t (its loss mask, behaviour log-prob, version, and later
the old/reference log-probs and advantage). Work never runs on that padded block; it runs on
micro-batches:

- `split_across_ranks`: each rank gets a share of the sequences, balanced by real tokens;
- `packed_micro_batches` (`trainer.packing`, the default): a rank's share cut into micro-batches
  of at most `trainer.micro_batch_tokens` real tokens (first-fit, longest first; a longer
  sequence alone), each run as one row of its sequences back to back, no padding
  (`model_inputs`; attention kernels in `rollmesh.models.varlen`);
- `micro_batches` (packing off): a rank's share sorted by length and cut greedily so that rows x
  longest row stays within the budget, run as right-padded rows;
- `plan`: both, with every rank given the same number of micro-batches (empty ones where a rank
  has less work), because FSDP's collectives need every rank in every forward and backward.

Packing and CPU: a packed row attends sequence by sequence (torch's causal SDPA kernel on each
slice), so its attention costs what the sequences cost alone; an earlier packed path through one
block-diagonal [N, N] mask cost O(N^2) and measured 3-5x slower than padded micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rollmesh.core import trajectory
from rollmesh.wire.messages import Group, Trajectory


@dataclass
class BatchData:
    """B sequences right-padded to T tokens; per-token tensors are aligned with `tokens`."""

    tokens: Tensor  # int64 [B, T]
    lengths: Tensor  # int64 [B]
    mask: Tensor  # float32 [B, T]: 1 on generated tokens (the loss)
    behaviour: Tensor  # float32 [B, T]: the engine's log-probs (0 elsewhere)
    versions: Tensor  # int64 [B, T]: weight version per token, -1 prompt/tool
    rewards: Tensor  # float32 [B]
    group_index: Tensor  # int64 [B]: equal values = samples of one prompt
    old: Tensor | None = None  # float32 [B, T]: log-probs at the start of the step
    ref: Tensor | None = None  # float32 [B, T]: reference-model log-probs
    advantages: Tensor | None = None  # float32 [B, T]
    truncated: Tensor | None = None  # bool [B]: cut off by the length limit (finish reason length)
    admitted: Tensor | None = None  # int64 [B]: the version its group was admitted at
    # What the batch's trajectories went through (`trajectory_counts`), for the step's metrics.
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, index: list[int]) -> dict[str, Tensor]:
        """The given sequences cut to their own longest length (a micro-batch)."""
        width = int(self.lengths[index].max())
        picked = {name: getattr(self, name) for name in
                  ("tokens", "mask", "behaviour", "versions", "old", "ref", "advantages")}
        out = {k: v[index, :width] for k, v in picked.items() if v is not None}
        out["attention_mask"] = (torch.arange(width)[None, :] < self.lengths[index, None]).long()
        return out


def from_groups(groups: list[Group]) -> BatchData:
    """The trainer's view of a batch of groups; a sample without a reward is an error."""
    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not trajs:
        raise ValueError("empty batch")
    lengths = [len(t.token_ids) for _, t in trajs]
    width = max(lengths)
    b = len(trajs)
    tokens = np.zeros((b, width), np.int64)
    mask = np.zeros((b, width), np.float32)
    behaviour = np.zeros((b, width), np.float32)
    versions = np.full((b, width), -1, np.int64)
    rewards = np.zeros(b, np.float32)
    for i, (_, t) in enumerate(trajs):
        n = lengths[i]
        if t.reward is None:
            raise ValueError(f"sample {t.sample_id} has no reward ({t.reward_status})")
        tokens[i, :n] = t.token_ids
        mask[i, :n] = t.loss_mask
        behaviour[i, :n] = np.where(t.loss_mask > 0, t.logprobs, 0.0)
        versions[i, :n] = t.versions
        rewards[i] = t.reward
    # The first token has no prediction, so it can never be in the loss.
    mask[:, 0] = 0.0
    return BatchData(
        tokens=torch.from_numpy(tokens), lengths=torch.tensor(lengths),
        mask=torch.from_numpy(mask), behaviour=torch.from_numpy(behaviour),
        versions=torch.from_numpy(versions), rewards=torch.from_numpy(rewards),
        group_index=torch.tensor([gi for gi, _ in trajs]),
        truncated=torch.tensor([t.finish_reason == "length" for _, t in trajs], dtype=torch.bool),
        admitted=torch.tensor([groups[gi].version_admitted for gi, _ in trajs]),
        counts=trajectory_counts([t for _, t in trajs]),
    )


def trajectory_counts(trajs: list[Trajectory]) -> dict[str, int]:
    """How many of the batch's response tokens are observations (tool results, environment and
    template tokens after the prompt: loss mask 0, version -1) and in how many samples
    (`observation_tokens`, `samples_with_observations`); how many samples a weight sync
    interrupted and that went on (`samples_resumed`), and of those, how many in the middle of
    a generated turn: generated tokens on both sides of the cut (`samples_resumed_mid_turn`)."""
    obs_tokens = with_obs = resumed = mid_turn = 0
    for t in trajs:
        after = slice(t.prompt_len, None)
        n = int(((t.loss_mask[after] == 0) & (t.versions[after] == -1)).sum())
        obs_tokens += n
        with_obs += n > 0
        cuts = [p for p in t.interrupted_at if 0 < p < len(t.token_ids)]
        resumed += bool(cuts)
        mid_turn += any(t.loss_mask[p - 1] and t.loss_mask[p] for p in cuts)
    return {"observation_tokens": obs_tokens, "samples_with_observations": with_obs,
            "samples_resumed": resumed, "samples_resumed_mid_turn": mid_turn}


def staleness(versions: Tensor, mask: Tensor, trainer_version: int) -> Tensor:
    """Per sample: trainer version minus the oldest version among its generated tokens (0 if
    it has none): `rollmesh.core.trajectory.staleness`, row by row."""
    generated = (versions >= 0) & (mask > 0)
    big = torch.iinfo(torch.int64).max
    oldest = torch.where(generated, versions, big).amin(dim=1)
    return torch.where(oldest == big, 0, trajectory.staleness(oldest, trainer_version))


def split_across_ranks(lengths: list[int], index: list[int], ranks: int) -> list[list[int]]:
    """Sequences `index` dealt to `ranks` ranks, longest first to the least-loaded rank (ties:
    lowest rank), so every rank gets about the same number of tokens. Deterministic."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(index, key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def micro_batches(lengths: list[int], index: list[int], budget_tokens: int) -> list[list[int]]:
    """Sort by length, cut greedily so rows x longest row <= budget (a longer sequence alone)."""
    out: list[list[int]] = []
    current: list[int] = []
    for i in sorted(index, key=lambda i: (lengths[i], i)):
        if current and (len(current) + 1) * lengths[i] > budget_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def packed_micro_batches(lengths: list[int], index: list[int],
                         budget_tokens: int) -> list[list[int]]:
    """First-fit decreasing: longest first, each into the first micro-batch with room for it
    (sum of lengths <= budget; a longer sequence alone). Rows of each in index order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(index, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget_tokens - lengths[i])
    return [sorted(b) for b in bins]


def plan(lengths: list[int], index: list[int], ranks: int, budget_tokens: int,
         packed: bool = False) -> list[list[list[int]]]:
    """Per rank, its micro-batches; every rank gets as many (padded with empty micro-batches)."""
    cut = packed_micro_batches if packed else micro_batches
    per_rank = [cut(lengths, share, budget_tokens)
                for share in split_across_ranks(lengths, index, ranks)]
    count = max(1, max(len(mbs) for mbs in per_rank))
    return [mbs + [[] for _ in range(count - len(mbs))] for mbs in per_rank]


def model_inputs(mb: dict[str, Tensor], packed: bool) -> dict[str, object]:
    """Adds to a micro-batch (`BatchData.rows`) what the model and the LM head take:
    - `head_pos` [M]: the input positions whose next token is a loss token (mask > 0), in the
      flattened input; `head_tgt` [M]: those tokens; `head_out` [M]: where their log-probs go
      in the flattened [B, W] micro-batch;
    - packed: `input_ids` and `position_ids` [1, N] (the real tokens of the rows back to back,
      positions restarting per sequence), `segments` (each sequence's (start, end)) and
      `value_index` [B, W + 1] (where the critic's token-aligned values come from).
    Built on the host, so none of it costs the device a synchronisation."""
    tokens, mask = mb["tokens"], mb["mask"]
    width = tokens.shape[1]
    lengths = mb["attention_mask"].sum(dim=1)
    b, t = (mask > 0).nonzero(as_tuple=True)
    out: dict[str, object] = dict(mb)
    out["head_out"] = b * width + t
    out["head_tgt"] = tokens[b, t]
    if not packed:
        out["head_pos"] = b * width + t - 1
        return out
    starts = torch.cumsum(lengths, 0) - lengths
    out["head_pos"] = starts[b] + t - 1
    real = mb["attention_mask"].bool()
    out["input_ids"] = tokens[real][None]
    out["position_ids"] = (torch.arange(width).expand_as(tokens))[real][None]
    bounds = torch.cumsum(lengths, 0).tolist()
    out["segments"] = list(zip([0] + bounds[:-1], bounds))
    # the critic's values, token-aligned [B, W + 1]: token t's from position t - 1, column
    # n_b (after the last token) from position n_b - 1; -1 where there is none
    col = torch.arange(width + 1)[None, :]
    inside = (col >= 1) & (col <= lengths[:, None])
    out["value_index"] = torch.where(inside, starts[:, None] + col - 1, -1)
    return out
