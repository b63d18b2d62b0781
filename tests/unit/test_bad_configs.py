"""Broken experiment and cluster files, each with the exact message a user gets.

Every case is TOML text written to a temporary file and loaded the way `rollmesh launch` loads
it; the message must name the file, the dotted key path and what was expected, e.g.
`x.toml: staleness.max_staleness: expected int >= 0, got -1`. A typo in a key or a plug-in name
gets a "did you mean".
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from rollmesh.config import ROLES, ConfigError, load_cluster, load_experiment

# A valid experiment; the cases below break it one way at a time.
EXP = """\
[model]
path = "tiny"
max_context = 512

[data]
train_path = "t.jsonl"
group_size = 2
max_prompt_tokens = 64

[rollout]
max_new_tokens = 16
batch_groups = 2
reward = "exact_match"
"""


def exp(*, drop: str = "", add: str = "", section: str = "", extra: str = "") -> str:
    """EXP with the line `drop` removed and `extra` added inside [section] (or at the end)."""
    text = EXP.replace(drop + "\n", "") if drop else EXP
    if section:
        head = f"[{section}]\n"
        text = text.replace(head, head + extra) if head in text else text + f"\n{head}{extra}"
    return text + add


def cluster(*, head: str = "", host: str = "", skip: str = "", roles: dict[str, str] | None = None,
            tail: str = "", experiment: str = "exp.toml") -> str:
    """A valid one-host cluster file running exp.toml, changed by the arguments."""
    text = (f'name = "t"\nexperiment = "{experiment}"\n{head}\n'
            f'[hosts.local]\naddress = "127.0.0.1"\n{host}\n')
    for role in ROLES:
        if role != skip:
            text += f'[roles.{role}]\nhost = "local"\n{(roles or {}).get(role, "")}\n'
    return text + tail


def registered(group: str, *builtin: str) -> str:
    names = sorted({*builtin, *(ep.name for ep in entry_points(group=group))})
    return ", ".join(map(repr, names))


EXP_KEYS = "name, seed, model, data, rollout, staleness, algorithm, trainer, sync, engine, metrics, sft"
ROLLOUT_KEYS = ("max_new_tokens, temperature, top_p, top_k, max_concurrent, batch_groups, "
                "max_turns, tool_timeout_s, python_tool, openai_agent, max_retries, engine_wait_s, over_sampling, group_filter, reward, "
                "reward_timeout_s, reward_memory_mb, reward_allow_unsafe, eval_every, eval_temperature, eval_n, "
                "eval_pass_threshold")
MODEL_KEYS = "path, tokenizer_path, dtype, trust_remote_code, max_context, lora"
CLUSTER_KEYS = "name, experiment, run_dir, launcher_address, hosts, roles, ports, share_gpus, colocate, slurm, launcher_cpus, role_max_restarts, settings"
HOST_KEYS = "address, user, port, identity_file, python, workdir, env, gpus, launch, ssh_options"

# (id, file text, expected message): {file} is the broken file, {exp} the experiment, {dir} tmp.
EXPERIMENTS = [
    ("toml_syntax_unclosed_table", exp().replace("[rollout]", "[rollout"),
     "{file}: invalid TOML: Expected ']' at the end of a table declaration (at line 10, column 9)"),
    ("toml_syntax_duplicate_key", exp(section="model", extra='path = "other"\n'),
     "{file}: invalid TOML: Cannot overwrite a value (at line 3, column 14)"),
    ("toml_syntax_bad_value", exp(section="rollout", extra="temperature = 1.0.0\n"),
     "{file}: invalid TOML: Expected newline or end of document after a statement "
     "(at line 11, column 18)"),
    ("wrong_type_str_for_int", exp(section="staleness", extra='max_staleness = "two"\n'),
     "{file}: staleness.max_staleness: expected int >= 0, got 'two'"),
    ("negative_staleness", exp(section="staleness", extra="max_staleness = -1\n"),
     "{file}: staleness.max_staleness: expected int >= 0, got -1"),
    ("float_for_int", exp(drop="batch_groups = 2", section="rollout", extra="batch_groups = 2.5\n"),
     "{file}: rollout.batch_groups: expected int > 0, got 2.5"),
    ("bool_for_int", exp(drop="group_size = 2", section="data", extra="group_size = true\n"),
     "{file}: data.group_size: expected int >= 1, got true"),
    ("top_p_out_of_range", exp(section="rollout", extra="top_p = 1.5\n"),
     "{file}: rollout.top_p: expected float in (0, 1], got 1.5"),
    ("negative_temperature", exp(section="rollout", extra="temperature = -0.1\n"),
     "{file}: rollout.temperature: expected float >= 0, got -0.1"),
    ("nan_temperature", exp(section="rollout", extra="temperature = nan\n"),
     "{file}: rollout.temperature: expected float >= 0, got nan"),
    ("engine_wait_zero", exp(section="rollout", extra="engine_wait_s = 0\n"),
     "{file}: rollout.engine_wait_s: expected float > 0, got 0"),
    ("engine_wait_text", exp(section="rollout", extra='engine_wait_s = "5m"\n'),
     "{file}: rollout.engine_wait_s: expected float > 0, got '5m'"),
    ("top_k_zero", exp(section="rollout", extra="top_k = 0\n"),
     "{file}: rollout.top_k: expected -1 (whole vocabulary) or int >= 1, got 0"),
    ("openai_agent_without_function", exp(section="rollout", extra='openai_agent = "my_agents"\n'),
     "{file}: rollout.openai_agent: expected 'package.module:function' (or ''), got 'my_agents'"),
    ("unknown_key_typo", exp(section="rollout", extra="max_new_token = 8\n"),
     f"{{file}}: rollout.max_new_token: unknown key (did you mean 'max_new_tokens'? expected one "
     f"of: {ROLLOUT_KEYS})"),
    ("unknown_section_typo", exp(add="\n[stalenes]\nmax_staleness = 2\n"),
     f"{{file}}: stalenes: unknown key (did you mean 'staleness'? expected one of: {EXP_KEYS})"),
    ("unknown_key_no_near_miss", exp(section="model", extra="colour = 1\n"),
     f"{{file}}: model.colour: unknown key (expected one of: {MODEL_KEYS})"),
    ("missing_data_section", EXP.split("[data]")[0] + "[rollout]" + EXP.split("[rollout]")[1],
     "{file}: data.train_path: missing required value (expected str)"),
    ("missing_model_path", exp(drop='path = "tiny"'),
     "{file}: model.path: missing required value (expected str)"),
    ("section_not_a_table", 'model = "tiny"\n' + EXP.split("[model]\npath = \"tiny\"\nmax_context = 512\n")[1],
     "{file}: model: expected a table, got 'tiny'"),
    ("unknown_literal", exp(section="model", extra='dtype = "fp8"\n'),
     "{file}: model.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'fp8'"),
    ("unknown_engine_kind", exp(add='\n[engine]\nkind = "vllm"\n'),
     "{file}: engine.kind: expected one of 'builtin', 'sglang', got 'vllm'"),
    ("unknown_reward", exp(drop='reward = "exact_match"', section="rollout",
                           extra='reward = "exact_mach"\n'),
     f"{{file}}: rollout.reward: expected one of {registered('rollmesh.rewards')} (entry points "
     "in group 'rollmesh.rewards') or 'module:function', got 'exact_mach' "
     "(did you mean 'exact_match'?)"),
    ("unknown_agent_loop", exp(section="data", extra='default_agent_loop = "multi_turn"\n'),
     f"{{file}}: data.default_agent_loop: expected one of {registered('rollmesh.agent_loops')} "
     "(entry points in group 'rollmesh.agent_loops'), got 'multi_turn'"),
    ("unknown_group_filter", exp(section="rollout", extra='group_filter = "dapo2"\n'),
     f"{{file}}: rollout.group_filter: expected one of "
     f"{registered('rollmesh.group_filters', 'none', 'dapo')} (built in, or entry points in "
     "group 'rollmesh.group_filters'), got 'dapo2' (did you mean 'dapo'?)"),
    ("sync_mode_with_staleness", exp(add="\n[staleness]\nsync_mode = true\nmax_staleness = 3\n"),
     "{file}: staleness.max_staleness: expected 0 (or no value) with sync_mode = true (the "
     "synchronous on-policy baseline), got 3"),
    ("unknown_staleness_measure", exp(add='\n[staleness]\nmeasure = "newest_token"\n'),
     "{file}: staleness.measure: expected one of 'admission', 'oldest_token', got "
     "'newest_token'"),
    ("sync_every_past_staleness", exp(add="\n[sync]\nsync_every = 3\n"),
     "{file}: sync.sync_every: expected int <= 2 (staleness.max_staleness + 1, or samples go "
     "stale before the next sync), got 3"),
    ("handles_for_sglang_from_a_cpu_trainer",
     exp(add='\n[sync]\ntransport = "handles"\n[engine]\nkind = "sglang"\n'
             '[trainer]\ndevice = "cpu"\n'),
     '{file}: sync.transport: expected broadcast or auto with engine.kind = "sglang" and a CPU '
     'trainer (SGLang takes handles only as CUDA IPC, from a GPU trainer), got handles'),
    ("context_too_short", exp(drop="max_context = 512", section="model", extra="max_context = 70\n"),
     "{file}: model.max_context: expected int >= 80 (data.max_prompt_tokens + "
     "rollout.max_new_tokens), got 70"),
    ("grpo_needs_groups", exp(drop="group_size = 2", section="data", extra="group_size = 1\n"),
     "{file}: data.group_size: expected int >= 2 with algorithm.advantage = 'grpo', got 1"),
    ("mini_batches_past_batch", exp(add="\n[trainer]\nmini_batches = 5\n"),
     "{file}: trainer.mini_batches: expected int <= 4 (rollout.batch_groups x data.group_size: "
     "the samples of one trainer step), got 5"),
    ("eval_without_eval_path", exp(section="rollout", extra="eval_every = 5\n"),
     "{file}: data.eval_path: missing required value (expected str, as rollout.eval_every = 5)"),
    ("kl_without_reference", exp(add="\n[algorithm]\nkl_coef = 0.1\n"),
     "{file}: algorithm.use_reference: expected true when kl_coef > 0 (the KL term needs "
     "reference log-probs), got false"),
    ("cap_mode_mask_without_cap", exp(add='\n[algorithm]\nbehaviour_cap_mode = "mask"\n'),
     "{file}: algorithm.behaviour_cap: missing required value (expected float > 0, as "
     "behaviour_cap_mode = 'mask' drops tokens above it)"),
    ("overlong_buffer_past_budget", exp(add="\n[algorithm]\noverlong_buffer = 17\n"),
     "{file}: algorithm.overlong_buffer: expected int <= 16 (algorithm.overlong_max_tokens, by "
     "default rollout.max_new_tokens), got 17"),
    ("bootstrap_and_mask_truncated", exp(add='\n[algorithm]\nadvantage = "gae"\ncritic_lr = 1e-5\n'
                                            "bootstrap_truncated = true\nmask_truncated = true\n"),
     "{file}: algorithm.bootstrap_truncated: expected false with mask_truncated = true "
     "(truncated responses are not trained on), got true"),
    ("kl_estimator_unknown", exp(add='\n[algorithm]\nkl_estimator = "k4"\n'),
     "{file}: algorithm.kl_estimator: expected one of 'k1', 'k2', 'k3', 'k3+', got 'k4'"),
    ("betas_length", exp(add="\n[trainer]\nbetas = [0.9]\n"),
     "{file}: trainer.betas: expected a list of 2 floats, got [0.9]"),
    ("betas_range", exp(add="\n[trainer]\nbetas = [0.9, 1.0]\n"),
     "{file}: trainer.betas[1]: expected float in [0, 1), got 1.0"),
    ("warmup_past_total", exp(add="\n[trainer]\nwarmup_steps = 20\ntotal_steps = 10\n"),
     "{file}: trainer.warmup_steps: expected int <= total_steps (10), got 20"),
    ("extra_args_not_strings", exp(add="\n[engine]\nextra_args = [\"--x\", 1]\n"),
     "{file}: engine.extra_args[1]: expected str, got 1"),
    ("trainer_max_restarts_negative", exp(add="\n[trainer]\nmax_restarts = -1\n"),
     "{file}: trainer.max_restarts: expected int >= 0, got -1"),
    ("progress_timeout_text", exp(add="\n[trainer]\nprogress_timeout_s = \"10m\"\n"),
     "{file}: trainer.progress_timeout_s: expected float >= 0, got '10m'"),
    ("engine_max_restarts_float", exp(add="\n[engine]\nmax_restarts = 2.5\n"),
     "{file}: engine.max_restarts: expected int >= 0, got 2.5"),
    ("reward_memory_too_small", exp(section="rollout", extra="reward_memory_mb = 16\n"),
     "{file}: rollout.reward_memory_mb: expected int >= 64, got 16"),
    ("file_not_found", None, "{file}: file not found"),
]

CLUSTERS = [
    ("cluster_toml_syntax", cluster().replace('[roles.trainer]', '[roles.trainer'),
     "{file}: invalid TOML: Expected ']' at the end of a table declaration (at line 22, column 15)"),
    ("cluster_unknown_key_typo", cluster().replace("experiment =", "experiement ="),
     f"{{file}}: experiement: unknown key (did you mean 'experiment'? expected one of: "
     f"{CLUSTER_KEYS})"),
    ("settings_unknown_key", cluster(tail="[settings.message_queue]\ncapacity = 8\n"),
     "{file}: settings.message_queue.capacity: unknown key (expected one of: capacity_groups, "
     "fsync_interval_s, compact_floor_bytes, max_pending_batches)"),
    ("host_unknown_key_typo", cluster(host='adress = "x"\n'),
     f"{{file}}: hosts.local.adress: unknown key (did you mean 'address'? expected one of: "
     f"{HOST_KEYS})"),
    ("unknown_host", cluster(skip="trainer", tail='[roles.trainer]\nhost = "gpu9"\n'),
     "{file}: roles.trainer.host: expected a name from [hosts] ('local'), got 'gpu9'"),
    ("missing_role_placement", cluster(skip="trainer"),
     "{file}: roles.trainer: missing required value (expected a table or a list of tables)"),
    ("missing_roles_section", 'name = "t"\nexperiment = "exp.toml"\n[hosts.local]\n'
                              'address = "127.0.0.1"\n',
     "{file}: roles.engine: missing required value (expected a table or a list of tables)"),
    ("duplicate_ports", cluster(tail="[ports]\nbase = 28000\nsynchronizer = 28008\n"),
     "{file}: ports.synchronizer: port 28008 on 127.0.0.1 is taken by both rollouter[0] and "
     "synchronizer[0]"),
    ("port_out_of_range", cluster(tail="[ports]\nengine = 70000\n"),
     "{file}: ports.engine: expected int in [1024, 65535], got 70000"),
    ("ssh_port_out_of_range", cluster(host="port = 70000\n"),
     "{file}: hosts.local.port: expected int in [1, 65535], got 70000"),
    ("ssh_host_key_checking_off", cluster(host='ssh_options = ["StrictHostKeyChecking=no"]\n'),
     "{file}: hosts.local.ssh_options[0]: host-key checking stays on: add the host's key to a "
     "known_hosts file instead"),
    ("ssh_host_key_checking_off_spaced",
     cluster(host='ssh_options = ["ConnectionAttempts=2", "StrictHostKeyChecking no"]\n'),
     "{file}: hosts.local.ssh_options[1]: host-key checking stays on: add the host's key to a "
     "known_hosts file instead"),
    ("ssh_options_not_list", cluster(host='ssh_options = "BatchMode=no"\n'),
     "{file}: hosts.local.ssh_options: expected a list of str, got 'BatchMode=no'"),
    ("launch_literal", cluster(host='launch = "remote"\n'),
     "{file}: hosts.local.launch: expected one of 'auto', 'local', 'ssh', 'slurm', got 'remote'"),
    ("per_process_zero", cluster(tail="[ports]\nper_process = 0\n"),
     "{file}: ports.per_process: expected int in [1, 64], got 0"),
    ("gpus_not_divisible_by_count",
     cluster(host="gpus = 3\n", roles={"engine": "count = 2\ngpus = [0, 1, 2]\n"}),
     "{file}: roles.engine.gpus: expected a list whose length is a multiple of count (2), "
     "got [0, 1, 2]"),
    ("trainer_ranks_mismatch", cluster(roles={"trainer": "count = 2\n"}),
     "{file}: roles.trainer: expected 1 process in all (trainer.ranks in {exp}), got 2"),
    ("experiment_missing", cluster(experiment="nope.toml"),
     "{file}: experiment: expected an existing file, got '{dir}/nope.toml'"),
    ("experiment_broken", cluster(),  # exp.toml itself is broken below
     "{exp}: staleness.max_staleness: expected int >= 0, got -1"),
    ("model_path_missing_on_this_machine", cluster(),  # exp.toml names a missing directory
     "{exp}: model.path: expected 'tiny', 'tiny:<spec>' or an existing model directory (the "
     "engine runs on host 'local', this machine), got '{dir}/no-such-model'"),
]

# Experiment files for the cluster cases that need a different one than EXP.
CLUSTER_EXPERIMENTS = {
    "experiment_broken": exp(add="\n[staleness]\nmax_staleness = -1\n"),
    "model_path_missing_on_this_machine": EXP.replace('path = "tiny"',
                                                      'path = "{dir}/no-such-model"'),
}


def _fill(text: str, tmp: Path, file: Path) -> str:
    return text.replace("{file}", str(file)).replace("{exp}", str(tmp / "exp.toml")).replace(
        "{dir}", str(tmp))


@pytest.mark.parametrize("text,expected", [c[1:] for c in EXPERIMENTS],
                         ids=[c[0] for c in EXPERIMENTS])
def test_broken_experiment(tmp_path: Path, text: str | None, expected: str) -> None:
    path = tmp_path / "x.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert str(err.value) == _fill(expected, tmp_path, path)


@pytest.mark.parametrize("case,text,expected", CLUSTERS, ids=[c[0] for c in CLUSTERS])
def test_broken_cluster(tmp_path: Path, case: str, text: str, expected: str) -> None:
    (tmp_path / "exp.toml").write_text(_fill(CLUSTER_EXPERIMENTS.get(case, EXP), tmp_path,
                                             tmp_path / "exp.toml"))
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert str(err.value) == _fill(expected, tmp_path, path)


def test_the_valid_bases_load(tmp_path: Path) -> None:
    """The cases above break files that load: each message is about the one change."""
    (tmp_path / "exp.toml").write_text(EXP)
    (tmp_path / "cluster.toml").write_text(cluster())
    loaded = load_cluster(tmp_path / "cluster.toml")
    assert loaded.experiment_config is not None
    assert loaded.experiment_config.rollout.reward == "exact_match"


def test_sync_mode_alone_is_the_synchronous_baseline(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    for extra in ("", "max_staleness = 0\n", "max_staleness = 1\n"):
        path.write_text(EXP + f"\n[staleness]\nsync_mode = true\n{extra}")
        staleness = load_experiment(path).staleness
        assert staleness.max_staleness == 0
        assert staleness.measure == "oldest_token"  # on-policy: nothing trained across a sync


def test_at_least_thirty_broken_configs() -> None:
    assert len(EXPERIMENTS) + len(CLUSTERS) >= 30
    print(f"broken configs checked: {len(EXPERIMENTS)} experiment + {len(CLUSTERS)} cluster")
