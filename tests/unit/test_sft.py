"""`rollmesh sft`: transcripts rendered by the chat template with the loss on assistant tokens
only, bad demonstrations named by file and line, and a warm-start that learns and is written in
the format the RL run loads. Also what the trainer counts of a batch's trajectories
(observations, interruptions) and the launcher's refusal to start before the warm-start."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rollmesh.config import load_experiment
from rollmesh.models.loading import load_model, tiny_tokenizer
from rollmesh.runtime.log import get_logger
from rollmesh.training.batching import trajectory_counts
from rollmesh.training.sft import SftError, load_transcripts, render_transcript, train
from rollmesh.core.trajectory import append_observation, append_tokens, new_trajectory

ROOT = Path(__file__).resolve().parents[2]

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>'
CONVO = [
    {"role": "user", "content": "What is 12 * 3?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "36"},
    {"role": "assistant", "content": "The answer is 36."},
]


def test_only_the_assistant_messages_are_in_the_loss():
    tok = tiny_tokenizer()
    ex = render_transcript(tok, CONVO)
    # The ids are exactly the template's rendering of the whole conversation...
    assert ex.ids == tok.encode(tok.apply_chat_template(CONVO, tokenize=False),
                                add_special_tokens=False)
    # ...and the masked tokens are the two assistant messages with their end of turn, nothing
    # of the user's, the tool's or the assistant headers.
    learned = [i for i, m in zip(ex.ids, ex.mask) if m]
    assert tok.decode(learned) == f"{CALL}<|im_end|>\nThe answer is 36.<|im_end|>\n"
    assert "assistant" not in tok.decode(learned)


def test_bad_demonstrations_name_the_file_and_line(tmp_path):
    tok = tiny_tokenizer()
    cases = {
        "not json\n": "demos.jsonl:1: not JSON",
        json.dumps({"prompt": "x"}) + "\n": "demos.jsonl:1: expected {\"messages\"",
        json.dumps({"messages": CONVO}) + "\n" + json.dumps(
            {"messages": [{"role": "user", "content": "hi"}]}) + "\n":
            "demos.jsonl:2: no assistant message",
        json.dumps({"messages": [{"role": "user", "content": 7}]}) + "\n":
            "demos.jsonl:1: the chat template cannot render it",
    }
    for text, expected in cases.items():
        path = tmp_path / "demos.jsonl"
        path.write_text(text)
        with pytest.raises(SftError, match=expected.replace("{", r"\{").replace("[", r"\[")):
            load_transcripts(path, tok, 256)
    path.write_text(json.dumps({"messages": CONVO}) + "\n")
    with pytest.raises(SftError, match="more than model.max_context"):
        load_transcripts(path, tok, 20)
    with pytest.raises(SftError, match="cannot read"):
        load_transcripts(tmp_path / "absent.jsonl", tok, 256)


def _experiment(tmp_path: Path, steps: int) -> Path:
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"messages": CONVO}) + "\n")
    cfg = tmp_path / "exp.toml"
    cfg.write_text(f"""
[model]
path = "{tmp_path / 'policy'}"
max_context = 256
[data]
train_path = "{demos}"
max_prompt_tokens = 64
[rollout]
max_new_tokens = 64
[sft]
init = "tiny"
data_path = "{demos}"
steps = {steps}
batch_size = 4
lr = 1e-2
warmup_steps = 5
[trainer]
device = "cpu"
""")
    return cfg


def test_the_warm_start_learns_its_demonstration_and_exports_a_loadable_policy(tmp_path):
    exp = load_experiment(_experiment(tmp_path, 80))
    summary = train(exp, get_logger("test"))
    assert summary["loss_last"] < 0.1 * summary["loss_first"], summary
    model, tok = load_model(str(tmp_path / "policy"), torch.device("cpu"), torch.float32)
    prompt = tok.encode(tok.apply_chat_template(CONVO[:1], tokenize=False,
                                                add_generation_prompt=True),
                        add_special_tokens=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                         eos_token_id=tok.eos_token_id)
    said = tok.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert said.startswith('<tool_call>{"name": "calculator"'), said  # a random model: never
    saved = json.loads((tmp_path / "policy" / "sft.json").read_text())
    assert saved["steps"] == 80 and len(saved["losses"]) == 80


def test_the_trainer_counts_observations_and_interruptions_mid_turn():
    def traj(sample: str) -> object:
        return new_trajectory(sample, "g", 0, [1, 2, 3], agent_loop="tool_agent")

    mid = traj("mid")  # cut inside its first turn, resumed there
    append_tokens(mid, [10, 11], [-0.1, -0.2], 0)
    mid.interrupted_at = [len(mid.token_ids)]
    append_tokens(mid, [12], [-0.3], 1)
    append_observation(mid, [20, 21, 22])
    append_tokens(mid, [13], [-0.1], 1)
    between = traj("between")  # cut while its tool ran: the next turn starts after the result
    append_tokens(between, [10], [-0.1], 0)
    append_observation(between, [20])
    between.interrupted_at = [len(between.token_ids)]
    append_tokens(between, [11], [-0.1], 1)
    plain = traj("plain")
    append_tokens(plain, [10, 11], [-0.1, -0.2], 0)
    counts = trajectory_counts([mid, between, plain])
    assert counts == {"observation_tokens": 4, "samples_with_observations": 2,
                      "samples_resumed": 2, "samples_resumed_mid_turn": 1}
    assert np.all(mid.versions[mid.loss_mask == 0] == -1)
