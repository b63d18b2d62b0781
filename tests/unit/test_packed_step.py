"""The trainer's step as it runs by default: packed micro-batches, log-probs from hidden states
through the chunked LM head, the proximal log-probs from the training forward; each against
the path it replaced (right-padded rows, full logits, `token_logprobs(shift=True)`,
`entropy_from_logits`, a separate no-grad pass), for every architecture the project supports."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollmesh.algorithms.head import head_logprobs
from rollmesh.algorithms.logits import entropy_from_logits, token_logprobs
from rollmesh.models.loading import tiny_tokenizer
from rollmesh.models.varlen import use_packed_attention
from rollmesh.training import batching, step
from rollmesh.training.batching import from_groups
from rollmesh.training.forward import fused_head_supported, token_logprobs_of
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import experiment, make_groups, max_diff, params_of, torch_threads

CPU = torch.device("cpu")


def _model(arch: str) -> torch.nn.Module:
    from transformers import (
        Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
        Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    common = dict(vocab_size=len(tiny_tokenizer()), hidden_size=48, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
    torch.manual_seed(3)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False))
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    # Gemma2: attention and final-logit soft-capping, every other layer a sliding window
    # shorter than the sequences, eager attention as the loader picks for it
    return Gemma2ForCausalLM(Gemma2Config(**common, head_dim=12, sliding_window=16,
                                          attn_implementation="eager"))


class _State:
    """What `token_logprobs_of` reads of a TrainState."""

    def __init__(self, temperature: float = 1.0):
        self.temperature, self.autocast, self.device = temperature, False, CPU


def _batch(seed: int = 0):
    return from_groups(make_groups(seed, n_groups=3))


def _old_path(model, data, rows, temperature):
    """What the step computed before: right-padded rows through the model's own kernel, the
    full logits, `token_logprobs(shift=True)` and `entropy_from_logits`, shifted."""
    mb = data.rows(rows)
    logits = model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"]).logits
    logp = token_logprobs(logits, mb["tokens"], temperature, shift=True) * mb["mask"]
    ent = entropy_from_logits(logits, temperature)
    ent = torch.cat([ent.new_zeros(ent.shape[0], 1), ent[:, :-1]], dim=1) * mb["mask"]
    return logp, ent, mb["mask"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "gemma2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_entropy_equal_the_padded_full_logits_path(arch, temperature):
    data = _batch()
    rows = list(range(data.size))
    with torch_threads(2):
        model = _model(arch).float()
        assert fused_head_supported(model)
        want_logp, want_ent, mask = _old_path(model, data, rows, temperature)
        weights = torch.randn(want_logp.shape, generator=torch.Generator().manual_seed(1))
        (want_logp * weights + want_ent).sum().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        use_packed_attention(model, CPU)
        mb = batching.model_inputs(data.rows(rows), packed=True)
        assert mb["input_ids"].shape == (1, int(data.lengths.sum()))  # no padding at all
        logp, ent = token_logprobs_of(_State(temperature), model, mb, entropy="grad")
        (logp * weights + ent).sum().backward()
    assert torch.equal(logp == 0, mask == 0)  # scored exactly the loss tokens
    torch.testing.assert_close(logp, want_logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=2e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        scale = float(want_grads[name].abs().max()) + 1e-6
        assert float((p.grad - want_grads[name]).abs().max()) < 1e-4 * scale, name


def test_padded_rows_take_the_same_head_and_give_the_same_numbers():
    data = _batch(1)
    rows = list(range(data.size))
    with torch_threads(2):
        model = _model("qwen2")
        want, _, _ = _old_path(model, data, rows, 1.0)
        padded, _ = token_logprobs_of(_State(), model,
                                      batching.model_inputs(data.rows(rows), packed=False))
        use_packed_attention(model, CPU)  # right-padded rows through the packed kernel too
        through, _ = token_logprobs_of(_State(), model,
                                       batching.model_inputs(data.rows(rows), packed=False))
    torch.testing.assert_close(padded, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(through, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_head_logprobs_never_builds_the_whole_logits_and_matches_them(softcap):
    """Values and gradients equal log_softmax of the full logits; with a chunk of 8 rows no
    intermediate ever has more than 8 x V elements."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 24, generator=gen, requires_grad=True)
    weight = torch.randn(300, 24, generator=gen, requires_grad=True)
    bias = torch.randn(300, generator=gen, requires_grad=True)
    targets = torch.randint(0, 300, (50,), generator=gen)
    g_lp, g_ent = torch.randn(50, generator=gen), torch.randn(50, generator=gen)

    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == 300
                    and out.shape[0] != 24):  # not the weight's transpose
                largest.append(out.shape[0])
            return out

    with Sizes():
        logp, ent = head_logprobs(hidden, weight, targets, bias=bias, temperature=0.8,
                                  softcap=softcap, entropy="grad", chunk=8)
        (logp * g_lp + ent * g_ent).sum().backward()
    assert largest and max(largest) <= 8
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    z = hidden @ weight.t() + bias
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    want_lp = token_logprobs(z, targets, 0.8)
    want_ent = entropy_from_logits(z, 0.8)
    (want_lp * g_lp + want_ent * g_ent).sum().backward()
    torch.testing.assert_close(logp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    for a, t in zip(got, (hidden, weight, bias)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-4)
    # as a metric: the same numbers, no graph
    _, metric = head_logprobs(hidden, weight, targets, bias=bias, temperature=0.8,
                              softcap=softcap, entropy="metric", chunk=8)
    assert not metric.requires_grad
    torch.testing.assert_close(metric, want_ent.detach(), atol=1e-5, rtol=1e-5)


def test_packed_plan_covers_every_sequence_once_within_the_real_token_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, 41).tolist() + [900]
    index = list(range(len(lengths)))
    plan = batching.plan(lengths, index, 3, 600, packed=True)
    assert len({len(p) for p in plan}) == 1  # every rank as many micro-batches
    seen = [i for per_rank in plan for mb in per_rank for i in mb]
    assert sorted(seen) == index
    for per_rank in plan:
        for mb in per_rank:
            assert mb == sorted(mb)
            assert sum(lengths[i] for i in mb) <= 600 or mb == [41]  # 900 alone
    loads = [sum(lengths[i] for mb in per_rank for i in mb) for per_rank in plan]
    assert max(loads) - min(loads) <= max(lengths)  # balanced by real tokens
    # packing wastes nothing: the padded plan pays for its padding in micro-batches
    padded = batching.plan(lengths, index, 1, 600)
    assert len(plan[0]) * 3 <= len(padded[0]) + 3


def _run_step(exp, groups, force_recompute: bool, monkeypatch):
    if force_recompute:
        monkeypatch.setattr(step, "old_from_training_forward", lambda state: False)
    with torch_threads(2):
        state = build_state(exp)
        data = prepare(state, from_groups(groups))
        stats = update_policy(state, data)
    monkeypatch.undo()
    return data, stats, params_of(state)


@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo", "gspo", "cispo"])
def test_one_forward_gives_the_update_the_separate_old_pass_gives(loss, monkeypatch):
    """mini_batches = 1: the old log-probs are the training forward's, detached; the step equals
    the one with a separate no-grad pass (same update, same metrics)."""
    exp = experiment(f'algorithm.loss="{loss}"')
    groups = make_groups(5, n_groups=3)
    one_data, one, one_params = _run_step(exp, groups, False, monkeypatch)
    two_data, two, two_params = _run_step(exp, groups, True, monkeypatch)
    assert one_data.old is None and two_data.old is not None
    assert max_diff(one_params, two_params) < 1e-6
    for key in ("loss", "pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm",
                "behaviour_weight_mean"):
        assert one[key] == pytest.approx(two[key], abs=1e-6), key


def test_the_separate_old_pass_runs_where_it_differs():
    for overrides in (("trainer.mini_batches=2",),
                      ("algorithm.use_reference=true", "algorithm.kl_coef=0.1",
                       "algorithm.kl_in_reward=true")):
        state = build_state(experiment(*overrides))
        assert not step.old_from_training_forward(state)
        assert prepare(state, from_groups(make_groups(1))).old is not None
    state = build_state(experiment('algorithm.old_logprobs="bypass"'))
    data = prepare(state, from_groups(make_groups(1)))
    assert torch.equal(data.old, data.behaviour)


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_metrics_wait_for_the_device_once_per_step_not_per_micro_batch(monkeypatch):
    """The step reads a tensor's value (`.item()`, `float()`: aten._local_scalar_dense, a device
    synchronisation on a GPU) as often with 12 micro-batches as with one, and never in a
    micro-batch's forward, loss or metrics. Cutting the batch into micro-batches on the host
    (`micro_batches`, CPU tensors only) is left out of the count."""
    from torch.utils._python_dispatch import _disable_current_modes

    real_micro_batches, real_loss = step.micro_batches, step.micro_batch_loss
    in_loss = []

    def host_side(*args, **kwargs):
        gen = real_micro_batches(*args, **kwargs)
        while True:
            with _disable_current_modes():
                item = next(gen, None)
            if item is None:
                return
            yield item

    def loss(*args, **kwargs):
        with _Syncs() as inner:
            out = real_loss(*args, **kwargs)
        in_loss.append(inner.count)
        return out

    monkeypatch.setattr(step, "micro_batches", host_side)
    monkeypatch.setattr(step, "micro_batch_loss", loss)
    groups = make_groups(2, n_groups=3)
    counts, passes = [], []
    for budget in (40, 100_000):
        state = build_state(experiment(f"trainer.micro_batch_tokens={budget}"))
        data = prepare(state, from_groups(groups))
        passes.append(len(list(real_micro_batches(state, data))))
        with _Syncs() as syncs:
            update_policy(state, data)
        counts.append(syncs.count)
    assert passes[0] >= 8 and passes[1] == 1
    assert len(in_loss) == passes[0] + passes[1] and set(in_loss) == {0}
    assert counts[0] == counts[1], counts


def test_the_old_padded_path_is_still_there_and_agrees(monkeypatch):
    groups = make_groups(4, n_groups=2)
    with torch_threads(2):
        a = build_state(experiment())
        b = build_state(experiment("trainer.packing=false"))
        assert b.model.config._attn_implementation == "sdpa"
        da, db = prepare(a, from_groups(groups)), prepare(b, from_groups(groups))
        sa, sb = update_policy(a, da), update_policy(b, db)
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-6)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-5)
    assert max_diff(params_of(a), params_of(b)) < 1e-4  # AdamW's first step: lr * g / |g|
    assert dataclasses.fields(da) == dataclasses.fields(db)


def test_activation_checkpointing_recomputes_packed_layers_with_the_same_kernel():
    """A layer recomputed in the backward pass attends sequence by sequence as in the forward:
    the same gradients with activation checkpointing as without."""
    groups = make_groups(6, n_groups=2)
    grads = []
    for flag in ("false", "true"):
        with torch_threads(2):
            state = build_state(experiment(f"trainer.gradient_checkpointing={flag}"))
            assert state.model.is_gradient_checkpointing == (flag == "true")
            data = prepare(state, from_groups(groups))
            norm = {"global_tokens": float(data.mask.sum()), "global_seqs": float(data.size)}
            for _, mb in step.micro_batches(state, data):
                step.micro_batch_loss(state, mb, norm)[0].backward()
        grads.append({n: p.grad.clone() for n, p in state.model.named_parameters()})
    assert max_diff(grads[0], grads[1]) < 1e-6
    assert max(float(g.abs().max()) for g in grads[0].values()) > 1e-4


def test_the_critic_runs_packed_and_gives_the_padded_values():
    """GAE: the critic's values (token-aligned, and after each sequence's last token) and its
    update are the same from a packed row as from right-padded rows."""
    from tests.unit.test_trainer import GAE

    groups = make_groups(7, n_groups=3)
    out = []
    for packing in ("true", "false"):
        with torch_threads(2):
            state = build_state(experiment(*GAE, f"trainer.packing={packing}"))
            data = from_groups(groups)
            values, after = step.critic_values(state, data)
            stats = update_policy(state, prepare(state, data))
        out.append((values, after, stats, params_of(state, "critic")))
    (v1, a1, s1, p1), (v2, a2, s2, p2) = out
    assert float(v2.abs().max()) > 0 and float(a2.abs().max()) > 0
    torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a1, a2, atol=1e-5, rtol=1e-5)
    assert s1["value_loss"] == pytest.approx(s2["value_loss"], rel=1e-5)
    assert max_diff(p1, p2) < 1e-4


@pytest.mark.parametrize("entropy", ["none", "metric"])
def test_head_gradient_without_the_entropy_term_and_with_no_rows(entropy):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 24, generator=gen, requires_grad=True)
    weight = torch.randn(200, 24, generator=gen, requires_grad=True)
    targets = torch.randint(0, 200, (30,), generator=gen)
    g = torch.randn(30, generator=gen)
    logp, _ = head_logprobs(hidden, weight, targets, temperature=1.3, entropy=entropy, chunk=7)
    (logp * g).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (token_logprobs(hidden @ weight.t(), targets, 1.3) * g).sum().backward()
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-5, rtol=1e-4)
    # no rows (an idle micro-batch): the head's weight still gets its (zero) gradient, so every
    # FSDP rank reduces the same parameters
    weight.grad = None
    empty, _ = head_logprobs(hidden[:0], weight, targets[:0], entropy=entropy)
    empty.sum().backward()
    assert weight.grad is not None and not weight.grad.any()


def _two_rank_step(rank: int, rendezvous: str) -> dict:
    from rollmesh.training.ranks import close_ranks, full_tensor, init_ranks

    torch.set_num_threads(1)
    ranks = init_ranks(rendezvous, rank, 2, "gloo", timeout_s=60)
    try:
        state = build_state(experiment(*_IDLE_RANK, "trainer.ranks=2"), ranks)
        stats = update_policy(state, prepare(state, from_groups(make_groups(8, n_groups=3))))
        return {"stats": stats, "params": {n: full_tensor(p).detach().clone()
                                           for n, p in state.model.named_parameters()}}
    finally:
        close_ranks(ranks)


# a budget at which rank 1 gets an idle micro-batch (no rows: the head sees no tokens), and an
# entropy bonus (the head's entropy gradient)
_IDLE_RANK = ("trainer.micro_batch_tokens=80", "algorithm.entropy_coef=0.01")


def test_two_fsdp_ranks_with_an_idle_micro_batch_train_as_one_rank():
    """FSDP2 over two gloo ranks on the default path (packed rows, the head inside the model's
    forward where FSDP gathers its weight): one rank's idle micro-batch still reduces every
    gradient, and the update is the one-rank update."""
    import multiprocessing

    from rollmesh.wire.transport import free_port

    data = from_groups(make_groups(8, n_groups=3))
    plan = batching.plan(data.lengths.tolist(), list(range(data.size)), 2, 80, packed=True)
    assert [] in plan[1] and [] not in plan[0]
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        two = pool.starmap(_two_rank_step, [(r, rendezvous) for r in range(2)], chunksize=1)
    with torch_threads(1):
        state = build_state(experiment(*_IDLE_RANK))
        one = update_policy(state, prepare(state, data))
    assert two[0]["stats"]["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert two[0]["stats"]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert max_diff(two[0]["params"], params_of(state)) < 1e-4
    assert max_diff(two[0]["params"], two[1]["params"]) == 0
