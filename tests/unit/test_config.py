"""rollmesh.config: example files load, every broken config gets its exact message, overrides,
rendering round trips, and every field is documented."""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path

import pytest

from rollmesh import config as C
from rollmesh.config import (
    ClusterConfig,
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    field_reference,
    load_cluster,
    load_experiment,
    parse_config,
    to_dict,
    to_toml,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["configs/tiny_cpu.toml", "configs/gsm8k_grpo.toml", "configs/tiny_cpu_lora.toml"]

EXP = '[model]\npath = "tiny"\n\n[data]\ntrain_path = "t.jsonl"\n'
TOP_KEYS = "name, seed, model, data, rollout, staleness, algorithm, trainer, sync, engine, metrics, sft"
ROLLOUT_KEYS = (
    "max_new_tokens, temperature, top_p, top_k, max_concurrent, batch_groups, max_turns, "
    "tool_timeout_s, python_tool, openai_agent, max_retries, engine_wait_s, over_sampling, group_filter, reward, reward_timeout_s, reward_memory_mb, reward_allow_unsafe, eval_every, eval_temperature, eval_n, eval_pass_threshold"
)
HOST_KEYS = "address, user, port, identity_file, python, workdir, env, gpus, launch, ssh_options"


def cluster(
    *,
    head: str = "",
    host: str = "",
    roles: dict[str, str] | None = None,
    skip: str = "",
    tail: str = "",
) -> str:
    """A valid one-host cluster file, changed by the arguments."""
    text = f'name = "t"\nexperiment = "exp.toml"\n{head}\n[hosts.local]\naddress = "127.0.0.1"\n{host}\n'
    for role in C.ROLES:
        if role != skip:
            text += f'[roles.{role}]\nhost = "local"\n{(roles or {}).get(role, "")}\n'
    return text + tail


# (id, kind, file text (None: no file), expected message; {file}, {exp}, {dir} are filled in)
BROKEN = [
    # -- experiment: keys
    (
        "top_unknown",
        "exp",
        "foo = 1\n" + EXP,
        f"{{file}}: foo: unknown key (expected one of: {TOP_KEYS})",
    ),
    (
        "section_unknown",
        "exp",
        EXP + "[rollout]\nmax_stalenes = 2\n",
        f"{{file}}: rollout.max_stalenes: unknown key (expected one of: {ROLLOUT_KEYS})",
    ),
    # -- types
    (
        "str_for_int",
        "exp",
        EXP + '[rollout]\nmax_new_tokens = "64"\n',
        "{file}: rollout.max_new_tokens: expected int > 0, got '64'",
    ),
    (
        "bool_for_int",
        "exp",
        EXP + "[staleness]\nmax_staleness = true\n",
        "{file}: staleness.max_staleness: expected int >= 0, got true",
    ),
    (
        "float_for_int",
        "exp",
        EXP + "[trainer]\ntotal_steps = 10.5\n",
        "{file}: trainer.total_steps: expected int > 0, got 10.5",
    ),
    (
        "int_for_str",
        "exp",
        '[model]\npath = 3\n[data]\ntrain_path = "t"\n',
        "{file}: model.path: expected str, got 3",
    ),
    (
        "str_for_bool",
        "exp",
        EXP + 'shuffle = "yes"\n',
        "{file}: data.shuffle: expected bool, got 'yes'",
    ),
    (
        "list_item_type",
        "exp",
        EXP + '[trainer]\nbetas = [0.9, "x"]\n',
        "{file}: trainer.betas[1]: expected float in [0, 1), got 'x'",
    ),
    (
        "str_for_list",
        "exp",
        EXP + '[engine]\nextra_args = "--foo"\n',
        "{file}: engine.extra_args: expected a list of str, got '--foo'",
    ),
    (
        "list_length",
        "exp",
        EXP + "[trainer]\nbetas = [0.9]\n",
        "{file}: trainer.betas: expected a list of 2 floats, got [0.9]",
    ),
    # -- bounds, one of each kind
    (
        "ge",
        "exp",
        EXP + "[staleness]\nmax_staleness = -1\n",
        "{file}: staleness.max_staleness: expected int >= 0, got -1",
    ),
    (
        "gt",
        "exp",
        EXP + "[rollout]\ntool_timeout_s = 0\n",
        "{file}: rollout.tool_timeout_s: expected float > 0, got 0",
    ),
    (
        "gt_le",
        "exp",
        EXP + "[rollout]\ntop_p = 1.5\n",
        "{file}: rollout.top_p: expected float in (0, 1], got 1.5",
    ),
    (
        "ge_lt",
        "exp",
        EXP + "[trainer]\nbetas = [0.9, 1.0]\n",
        "{file}: trainer.betas[1]: expected float in [0, 1), got 1.0",
    ),
    (
        "ge_le",
        "exp",
        EXP + "[algorithm]\ngamma = -0.1\n",
        "{file}: algorithm.gamma: expected float in [0, 1], got -0.1",
    ),
    (
        "ge_float",
        "exp",
        EXP + "[rollout]\nover_sampling = 0.5\n",
        "{file}: rollout.over_sampling: expected float >= 1, got 0.5",
    ),
    (
        "optional_gt",
        "exp",
        EXP + "[algorithm]\ndual_clip = 1.0\n",
        "{file}: algorithm.dual_clip: expected float > 1, got 1.0",
    ),
    (
        "nan",
        "exp",
        EXP + "[rollout]\ntemperature = nan\n",
        "{file}: rollout.temperature: expected float >= 0, got nan",
    ),
    (
        "top_k",
        "exp",
        EXP + "[rollout]\ntop_k = 0\n",
        "{file}: rollout.top_k: expected -1 (whole vocabulary) or int >= 1, got 0",
    ),
    # -- choices
    (
        "literal",
        "exp",
        EXP + '[algorithm]\nadvantage = "ppo"\n',
        "{file}: algorithm.advantage: expected one of 'grpo', 'grpo_mean_only', 'rloo', 'reinforce_pp', 'gae', got 'ppo'",
    ),
    (
        "literal_type",
        "exp",
        '[model]\npath = "tiny"\ndtype = 16\n[data]\ntrain_path = "t"\n',
        "{file}: model.dtype: expected one of 'float32', 'bfloat16', 'float16', got 16",
    ),
    # -- missing values and tables
    (
        "missing_required",
        "exp",
        '[model]\npath = "tiny"\n[data]\nformat = "jsonl"\n',
        "{file}: data.train_path: missing required value (expected str)",
    ),
    (
        "missing_section",
        "exp",
        '[model]\npath = "tiny"\n',
        "{file}: data.train_path: missing required value (expected str)",
    ),
    ("section_not_table", "exp", "rollout = 3\n" + EXP, "{file}: rollout: expected a table, got 3"),
    (
        "toml_syntax",
        "exp",
        '[model\npath = "tiny"\n',
        "{file}: invalid TOML: Expected ']' at the end of a table declaration (at line 1, column 7)",
    ),
    ("missing_file", "exp", None, "{file}: file not found"),
    # -- cross-field checks
    (
        "warmup",
        "exp",
        EXP + "[trainer]\nwarmup_steps = 20\ntotal_steps = 10\n",
        "{file}: trainer.warmup_steps: expected int <= total_steps (10), got 20",
    ),
    (
        "kl_needs_reference",
        "exp",
        EXP + "[algorithm]\nkl_coef = 0.1\n",
        "{file}: algorithm.use_reference: expected true when kl_coef > 0 (the KL term needs reference log-probs), got false",
    ),
    (
        "decoupled_bypass",
        "exp",
        EXP + '[algorithm]\nloss = "decoupled_ppo"\nold_logprobs = "bypass"\n',
        "{file}: algorithm.old_logprobs: expected 'recompute' with loss = 'decoupled_ppo', got 'bypass'",
    ),
    (
        "context",
        "exp",
        EXP.replace('"tiny"\n', '"tiny"\nmax_context = 1024\n'),
        "{file}: model.max_context: expected int >= 2048 (data.max_prompt_tokens + rollout.max_new_tokens), got 1024",
    ),
    (
        "group_size",
        "exp",
        EXP + "group_size = 1\n",
        "{file}: data.group_size: expected int >= 2 with algorithm.advantage = 'grpo', got 1",
    ),
    (
        "sync_vs_staleness",
        "exp",
        EXP + "[sync]\nsync_every = 3\n",
        "{file}: sync.sync_every: expected int <= 2 (staleness.max_staleness + 1, or samples go stale before the next sync), got 3",
    ),
    (
        "eval_path",
        "exp",
        EXP + "[rollout]\neval_every = 10\n",
        "{file}: data.eval_path: missing required value (expected str, as rollout.eval_every = 10)",
    ),
    (
        "builtin_tp",
        "exp",
        EXP + "[engine]\ntp_size = 2\n",
        "{file}: engine.tp_size: expected 1 for kind = 'builtin', got 2",
    ),
    # -- cluster: keys and types
    (
        "cluster_top_unknown",
        "cluster",
        "foo = 1\n" + cluster(),
        "{file}: foo: unknown key (expected one of: name, experiment, run_dir, launcher_address, hosts, roles, ports, share_gpus, colocate, slurm, launcher_cpus, role_max_restarts, settings)",
    ),
    (
        "host_unknown_key",
        "cluster",
        cluster(host='adress = "x"\n'),
        f"{{file}}: hosts.local.adress: unknown key (did you mean 'address'? expected one of: {HOST_KEYS})",
    ),
    (
        "host_missing_address",
        "cluster",
        cluster().replace('address = "127.0.0.1"\n', ""),
        "{file}: hosts.local.address: missing required value (expected str)",
    ),
    (
        "host_not_table",
        "cluster",
        'name = "t"\nexperiment = "exp.toml"\n[hosts]\nlocal = 3\n',
        "{file}: hosts.local: expected a table, got 3",
    ),
    (
        "ssh_port",
        "cluster",
        cluster(host="port = 0\n"),
        "{file}: hosts.local.port: expected int in [1, 65535], got 0",
    ),
    (
        "env_value",
        "cluster",
        cluster(host="env = { A = 1 }\n"),
        "{file}: hosts.local.env.A: expected str, got 1",
    ),
    (
        "env_not_table",
        "cluster",
        cluster(host='env = "A=1"\n'),
        "{file}: hosts.local.env: expected a table of str, got 'A=1'",
    ),
    (
        "ports_base",
        "cluster",
        cluster(tail="[ports]\nbase = 80\n"),
        "{file}: ports.base: expected int in [1024, 65535], got 80",
    ),
    (
        "gpu_id_negative",
        "cluster",
        cluster(host="gpus = 2\n", roles={"engine": "gpus = [-1]\n"}),
        "{file}: roles.engine.gpus[0]: expected int >= 0, got -1",
    ),
    (
        "placement_not_table",
        "cluster",
        cluster(skip="engine", tail="[roles]\nengine = [1]\n"),
        "{file}: roles.engine[0]: expected a table, got 1",
    ),
    # -- cluster: placement checks
    (
        "unknown_host",
        "cluster",
        cluster(roles={"trainer": 'host = "gpu9"\n'}).replace(
            '[roles.trainer]\nhost = "local"\n', "[roles.trainer]\n"
        ),
        "{file}: roles.trainer.host: expected a name from [hosts] ('local'), got 'gpu9'",
    ),
    (
        "missing_role",
        "cluster",
        cluster(skip="synchronizer"),
        "{file}: roles.synchronizer: missing required value (expected a table or a list of tables)",
    ),
    (
        "empty_role",
        "cluster",
        cluster(skip="engine", tail="[roles]\nengine = []\n"),
        "{file}: roles.engine: expected at least one placement, got []",
    ),
    (
        "singleton_count",
        "cluster",
        cluster(roles={"synchronizer": "count = 2\n"}),
        "{file}: roles.synchronizer.count: expected 1 (synchronizer is a single process), got 2",
    ),
    (
        "singleton_placements",
        "cluster",
        cluster(
            skip="synchronizer",
            tail='[[roles.synchronizer]]\nhost = "local"\n[[roles.synchronizer]]\nhost = "local"\n',
        ),
        "{file}: roles.synchronizer: expected one placement (synchronizer is a single process), got 2",
    ),
    (
        "rollout_shards_without_their_workers",
        "cluster",
        cluster(roles={"rollouter": "count = 3\n", "agent_worker": "count = 4\n",
                       "reward_worker": "count = 2\n"}),
        "{file}: roles.reward_worker: expected at least 3 in all (one per rollouter: each "
        "rollout shard has its own), got 2",
    ),
    (
        "gpus_not_multiple",
        "cluster",
        cluster(host="gpus = 4\n", roles={"engine": "count = 2\ngpus = [0, 1, 2]\n"}),
        "{file}: roles.engine.gpus: expected a list whose length is a multiple of count (2), got [0, 1, 2]",
    ),
    (
        "gpu_overcommit",
        "cluster",
        cluster(host="gpus = 2\n", roles={"engine": "gpus = [0]\n", "trainer": "gpus = [0]\n"}),
        "{file}: roles.trainer.gpus[0]: GPU 0 on host 'local' is given to both engine[0] and trainer[0]",
    ),
    (
        "gpu_beyond_host",
        "cluster",
        cluster(host="gpus = 1\n", roles={"engine": "gpus = [0, 1]\n"}),
        "{file}: roles.engine.gpus[1]: expected int in [0, 1) (host 'local' has 1 GPU), got 1",
    ),
    (
        "gpu_on_cpu_host",
        "cluster",
        cluster(roles={"engine": "gpus = [0]\n"}),
        "{file}: roles.engine.gpus: expected [] (host 'local' has no GPUs), got [0]",
    ),
    (
        "trainer_two_gpus_per_rank",
        "cluster",
        cluster(host="gpus = 2\n", roles={"trainer": "gpus = [0, 1]\n"}),
        "{file}: roles.trainer.gpus: expected at most 1 GPU id (one per rank), got [0, 1]",
    ),
    (
        "identity_file",
        "cluster",
        cluster(host='identity_file = "{dir}/nope"\n'),
        "{file}: hosts.local.identity_file: expected an existing file, got '{dir}/nope'",
    ),
    # -- cluster: ports
    (
        "port_clash",
        "cluster",
        cluster(tail="[ports]\nbase = 28000\nrollouter = 28004\n"),
        "{file}: ports.rollouter: port 28004 on 127.0.0.1 is taken by both engine[0] and rollouter[0]",
    ),
    (
        "port_clash_launcher",
        "cluster",
        cluster(tail="[ports]\nbase = 28000\nengine = 28002\n"),
        "{file}: ports.engine: port 28002 on 127.0.0.1 is taken by both the launcher and engine[0]",
    ),
    (
        "ports_past_end",
        "cluster",
        cluster(tail="[ports]\nbase = 65530\n"),
        "{file}: ports.base: engine[0] would get ports 65534-65537, past 65535",
    ),
    # -- cluster against its experiment
    (
        "experiment_missing",
        "cluster",
        cluster().replace('"exp.toml"', '"nope.toml"'),
        "{file}: experiment: expected an existing file, got '{dir}/nope.toml'",
    ),
    (
        "engine_count",
        "cluster",
        cluster(roles={"engine": "count = 2\n"}),
        "{file}: roles.engine: expected 1 process in all (engine.count in {exp}), got 2",
    ),
]


def _write_case(tmp_path: Path, kind: str, text: str | None) -> tuple[Path, dict[str, str]]:
    exp = tmp_path / "exp.toml"
    exp.write_text(EXP)
    path = tmp_path / ("x.toml" if kind == "exp" else "cluster.toml")
    names = {"file": str(path), "exp": str(exp), "dir": str(tmp_path)}
    if text is not None:
        path.write_text(text.replace("{dir}", str(tmp_path)))
    return path, names


@pytest.mark.parametrize("kind,text,expected", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_config_message(tmp_path: Path, kind: str, text: str | None, expected: str) -> None:
    path, names = _write_case(tmp_path, kind, text)
    with pytest.raises(ConfigError) as err:
        (load_experiment if kind == "exp" else load_cluster)(str(path))
    assert str(err.value) == expected.format(**names)


def test_cluster_names_the_experiment_file_for_its_errors(tmp_path: Path) -> None:
    path, names = _write_case(tmp_path, "cluster", cluster())
    (tmp_path / "exp.toml").write_text(EXP + "[staleness]\nmax_staleness = -1\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert str(err.value) == f"{names['exp']}: staleness.max_staleness: expected int >= 0, got -1"


def test_sglang_engines_need_their_gpus(tmp_path: Path) -> None:
    path, names = _write_case(
        tmp_path, "cluster", cluster(host="gpus = 2\n", roles={"engine": "gpus = [0]\n"})
    )
    (tmp_path / "exp.toml").write_text(EXP + '[engine]\nkind = "sglang"\ntp_size = 2\n')
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert str(err.value) == (
        f"{names['file']}: roles.engine.gpus: expected 2 GPU ids (count x engine.tp_size: SGLang runs on GPUs), got [0]"
    )


def test_error_attributes(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text(EXP + "[staleness]\nmax_staleness = -1\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert isinstance(err.value, ValueError)
    assert (err.value.source, err.value.key, err.value.problem) == (
        str(path),
        "staleness.max_staleness",
        "expected int >= 0, got -1",
    )


# --- the example files ------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_experiments_load(name: str) -> None:
    cfg = load_experiment(ROOT / name)
    assert isinstance(cfg, ExperimentConfig)


def test_example_experiment_values() -> None:
    tiny = load_experiment(ROOT / "configs/tiny_cpu.toml")
    assert tiny.model.path == "tiny" and tiny.data.train_path == "configs/data/letters_train.jsonl"
    assert tiny.rollout.reward == "letter_share"
    gpu = load_experiment(ROOT / "configs/gsm8k_grpo.toml")
    assert (gpu.model.path, gpu.model.dtype) == ("/models/Qwen2.5-1.5B-Instruct", "bfloat16")
    assert (gpu.algorithm.advantage, gpu.algorithm.loss) == ("grpo", "decoupled_ppo")
    assert (gpu.staleness.max_staleness, gpu.engine.kind) == (2, "sglang")


def test_local_cluster_loads_with_its_experiment() -> None:
    c = load_cluster(ROOT / "launch/local.toml")
    assert c.experiment == str(ROOT / "configs/tiny_cpu.toml")
    assert c.experiment_config == load_experiment(ROOT / "configs/tiny_cpu.toml")
    assert set(c.hosts) == {"local"} and c.hosts["local"].address == "127.0.0.1"
    procs = c.processes()
    assert {p.role for p in procs} == set(C.ROLES)
    assert all(p.host == "local" and p.gpus == () for p in procs)
    ports = [port for p in procs for port in range(p.port, p.port + c.ports.per_process)]
    assert len(ports) == len(set(ports)) and min(ports) == c.launcher_port + c.ports.per_process


def test_role_max_restarts_is_five_by_default_and_can_be_raised() -> None:
    # the launcher's limit for the rollouter, the queue, the synchronizer and the workers (the
    # trainer's and the engines' are the experiment's): a chaos soak kills each many times
    assert load_cluster(ROOT / "launch/local.toml").role_max_restarts == 5
    raised = load_cluster(ROOT / "launch/local.toml", ["role_max_restarts=100"])
    assert raised.role_max_restarts == 100
    with pytest.raises(ConfigError, match="role_max_restarts"):
        load_cluster(ROOT / "launch/local.toml", ["role_max_restarts=-1"])


def test_placements_across_hosts(tmp_path: Path) -> None:
    text = cluster(
        host="gpus = 4\n",
        skip="engine",
        tail=(
            '[hosts.gpu2]\naddress = "10.0.0.2"\ngpus = 2\n'
            '[[roles.engine]]\nhost = "local"\ncount = 2\ngpus = [0, 1, 2, 3]\n'
            '[[roles.engine]]\nhost = "gpu2"\ngpus = [0, 1]\n'
        ),
    )
    path, _ = _write_case(tmp_path, "cluster", text)
    (tmp_path / "exp.toml").write_text(EXP + '[engine]\nkind = "sglang"\ncount = 3\ntp_size = 2\n')
    c = load_cluster(path)
    engines = [p for p in c.processes() if p.role == "engine"]
    assert [(p.index, p.host, p.gpus) for p in engines] == [
        (0, "local", (0, 1)),
        (1, "local", (2, 3)),
        (2, "gpu2", (0, 1)),
    ]


def test_gpu_overcommit_within_a_second_placement(tmp_path: Path) -> None:
    text = cluster(
        host="gpus = 4\n",
        skip="engine",
        tail=(
            '[[roles.engine]]\nhost = "local"\ngpus = [0]\n[[roles.engine]]\nhost = "local"\ngpus = [1, 0]\n'
        ),
    )
    path, names = _write_case(tmp_path, "cluster", text)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert (
        str(err.value)
        == f"{names['file']}: roles.engine[1].gpus[1]: GPU 0 on host 'local' is given to both engine[0] and engine[1]"
    )


def test_existing_identity_file_is_accepted(tmp_path: Path) -> None:
    key = tmp_path / "id_test"
    key.write_text("not really a key")
    path, _ = _write_case(tmp_path, "cluster", cluster(host=f'identity_file = "{key}"\n'))
    assert load_cluster(path).hosts["local"].identity_file == str(key)


# --- overrides --------------------------------------------------------------------------------


@pytest.fixture
def exp_file(tmp_path: Path) -> Path:
    path = tmp_path / "x.toml"
    path.write_text(EXP)
    return path


def test_override_sets_nested_values(exp_file: Path) -> None:
    cfg = load_experiment(
        exp_file, ["rollout.max_new_tokens=5", "trainer.betas=[0.8, 0.9]", "algorithm.dual_clip=3"]
    )
    assert cfg.rollout.max_new_tokens == 5
    assert cfg.trainer.betas == [0.8, 0.9]
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)


def test_override_creates_a_missing_section(exp_file: Path) -> None:
    assert load_experiment(exp_file, ["staleness.max_staleness=0"]).staleness.max_staleness == 0


def test_override_string_without_quotes(exp_file: Path) -> None:
    cfg = load_experiment(
        exp_file,
        [
            "model.path=/models/Qwen2.5-1.5B",
            "data.format=jsonl",
            'name="quoted"',
            "data.system_prompt=Be brief.",
        ],
    )
    assert cfg.model.path == "/models/Qwen2.5-1.5B"
    assert cfg.data.format == "jsonl"
    assert cfg.name == "quoted"
    assert cfg.data.system_prompt == "Be brief."


def test_override_unquoted_text_for_a_str_field_is_kept_as_typed(exp_file: Path) -> None:
    # 2024-01-01 and 1.5 are TOML values (a date, a float); a str field takes the text.
    cfg = load_experiment(
        exp_file, ["name=2024-01-01", "model.path=1.5", "data.system_prompt=true"]
    )
    assert (cfg.name, cfg.model.path, cfg.data.system_prompt) == ("2024-01-01", "1.5", "true")
    with pytest.raises(ConfigError) as err:  # ... but only for str fields
        load_experiment(exp_file, ["rollout.max_new_tokens=2024-01-01"])
    assert str(err.value) == (
        "--set rollout.max_new_tokens=2024-01-01: rollout.max_new_tokens: expected int > 0, got 2024-01-01"
    )


def test_override_type_error_names_the_override(exp_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_experiment(exp_file, ["rollout.max_new_tokens=abc"])
    assert (
        str(err.value)
        == "--set rollout.max_new_tokens=abc: rollout.max_new_tokens: expected int > 0, got 'abc'"
    )


def test_override_unknown_key_names_the_override(exp_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_experiment(exp_file, ["rollout.max_stalenes=2"])
    assert str(err.value) == (
        f"--set rollout.max_stalenes=2: rollout.max_stalenes: unknown key (expected one of: {ROLLOUT_KEYS})"
    )


def test_table_created_by_an_override_names_file_and_override(exp_file: Path) -> None:
    path = exp_file.parent / "cluster.toml"
    (exp_file.parent / "exp.toml").write_text(EXP)
    path.write_text(cluster())
    with pytest.raises(ConfigError) as err:
        load_cluster(path, ["hosts.gpu2.user=me"])
    assert str(err.value) == (
        f"{path} (with --set hosts.gpu2.user=me): hosts.gpu2.address: missing required value (expected str)"
    )
    exp_file.write_text('[model]\npath = "tiny"\n')
    with pytest.raises(ConfigError) as err:
        load_experiment(exp_file, ["data.format=jsonl"])
    assert str(err.value) == (
        f"{exp_file} (with --set data.format=jsonl): data.train_path: missing required value (expected str)"
    )
    with pytest.raises(ConfigError) as err:  # a bad value the override itself set names it alone
        load_experiment(exp_file, ["data.train_path=t.jsonl", "data.format=csv"])
    assert str(err.value).startswith("--set data.format=csv: data.format: expected one of 'auto'")


def test_ports_has_an_explicit_port_per_role() -> None:
    port_fields = [f.name for f in dataclasses.fields(C.PortsConfig)]
    assert port_fields[2:] == list(C.ROLES)


def test_file_errors_still_name_the_file(exp_file: Path) -> None:
    exp_file.write_text(EXP + "[rollout]\ntop_p = 2.0\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(exp_file, ["rollout.max_new_tokens=5"])
    assert str(err.value) == f"{exp_file}: rollout.top_p: expected float in (0, 1], got 2.0"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("rollout.max_new_tokens", "--set rollout.max_new_tokens: expected section.key=value"),
        ("=3", "--set =3: expected section.key=value"),
        (
            "rollout..x=3",
            "--set rollout..x=3: invalid key 'rollout..x' (expected dotted keys, e.g. rollout.top_p)",
        ),
        ("a\nb=3", "--set a\nb=3: invalid key 'a\\nb' (expected dotted keys, e.g. rollout.top_p)"),
        (
            "model.path.x=1",
            "--set model.path.x=1: model.path: cannot set a key inside 'tiny' in {file} (not a table)",
        ),
    ],
)
def test_malformed_override(exp_file: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_experiment(exp_file, [override])
    assert str(err.value) == expected.format(file=exp_file)


def test_apply_overrides_copies() -> None:
    data = {"rollout": {"max_new_tokens": 4}}
    out = apply_overrides(
        data, ["rollout.max_new_tokens=8", 'hosts."my.host".address=10.0.0.1', "x=[1, 2]"], "d"
    )
    assert data == {"rollout": {"max_new_tokens": 4}}
    assert out == {
        "rollout": {"max_new_tokens": 8},
        "hosts": {"my.host": {"address": "10.0.0.1"}},
        "x": [1, 2],
    }


def test_cluster_overrides_go_to_the_right_file() -> None:
    c = load_cluster(
        ROOT / "launch/local.toml", ["ports.base=30000", "staleness.max_staleness=0", "name=other"]
    )
    assert c.ports.base == 30000 and c.name == "other"
    assert c.experiment_config.staleness.max_staleness == 0
    with pytest.raises(ConfigError) as err:
        load_cluster(ROOT / "launch/local.toml", ["roles.synchronizer.count=2"])
    assert (
        str(err.value)
        == "--set roles.synchronizer.count=2: roles.synchronizer.count: expected 1 (synchronizer is a single process), got 2"
    )


# --- types, wire dicts and rendering ------------------------------------------------------------


def test_int_accepted_for_float_and_converted(exp_file: Path) -> None:
    cfg = load_experiment(exp_file, ["rollout.temperature=1"])
    assert cfg.rollout.temperature == 1.0 and type(cfg.rollout.temperature) is float


def test_seeds_default_to_the_top_level_seed(exp_file: Path) -> None:
    cfg = load_experiment(exp_file, ["seed=7", "trainer.seed=3"])
    assert (cfg.data.seed, cfg.trainer.seed) == (7, 3)


def test_parse_config_from_a_wire_dict() -> None:
    cfg = load_experiment(ROOT / "configs/gsm8k_grpo.toml")
    wire = to_dict(cfg)
    assert wire["algorithm"]["dual_clip"] is None  # None is kept for the wire, omitted in TOML
    assert parse_config(ExperimentConfig, wire, "spec") == cfg
    wire["rollout"]["top_p"] = 0
    with pytest.raises(ConfigError) as err:
        parse_config(ExperimentConfig, wire, "spec from launcher")
    assert str(err.value) == "spec from launcher: rollout.top_p: expected float in (0, 1], got 0"
    with pytest.raises(ConfigError) as err:
        parse_config(ExperimentConfig, [1], "spec")
    assert str(err.value) == "spec: expected a table, got [1]"


@pytest.mark.parametrize("name", EXAMPLES)
def test_to_toml_round_trip(name: str) -> None:
    cfg = load_experiment(ROOT / name)
    assert parse_config(ExperimentConfig, tomllib.loads(to_toml(cfg)), "rt") == cfg


def test_to_toml_round_trip_odd_values(exp_file: Path) -> None:
    cfg = load_experiment(
        exp_file,
        [
            'data.system_prompt="a \\"quoted\\"\\n\\ttab \\\\ back \\u0001 ünï"',
            "algorithm.dual_clip=3.5",
            "trainer.lr=1e-7",
            "engine.extra_args=['--served-model-name', \"y z\"]",
            "rollout.tool_timeout_s=inf",
        ],
    )
    assert cfg.data.system_prompt == 'a "quoted"\n\ttab \\ back \x01 ünï'
    assert parse_config(ExperimentConfig, tomllib.loads(to_toml(cfg)), "rt") == cfg


def test_cluster_to_toml_round_trip(tmp_path: Path) -> None:
    text = cluster(
        host='env = { A = "1", "B.C" = "x" }\ngpus = 2\n',
        roles={"engine": "gpus = [0]\n"},
        tail='[hosts.empty_env]\naddress = "10.0.0.3"\nenv = {}\n[ports]\nengine = 40000\n',
    )
    path, _ = _write_case(tmp_path, "cluster", text)
    c = load_cluster(path)
    again = parse_config(ClusterConfig, tomllib.loads(to_toml(c)), "rt")
    assert again == c and again.experiment_config is None  # derived, not part of the file


# --- documentation ------------------------------------------------------------------------------


def _config_dataclasses() -> list[type]:
    return [
        obj
        for _, obj in inspect.getmembers(C, inspect.isclass)
        if dataclasses.is_dataclass(obj) and obj.__module__.startswith(C.__name__ + ".")
    ]


def test_every_field_has_help() -> None:
    classes = _config_dataclasses()
    assert ExperimentConfig in classes and ClusterConfig in classes and len(classes) >= 14
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), (
                f"{cls.__name__}.{f.name}"
            )


def test_field_reference_rows() -> None:
    rows = {r["key"]: r for r in field_reference(ExperimentConfig)}
    assert rows["staleness.max_staleness"]["expected"] == "int >= 0"
    assert rows["rollout.top_p"]["expected"] == "float in (0, 1]"
    assert rows["model.path"]["default"] is dataclasses.MISSING
    assert rows["trainer.betas"]["default"] == [0.9, 0.999]
    cluster_rows = {r["key"]: r for r in field_reference(ClusterConfig)}
    assert cluster_rows["hosts.<name>.port"]["expected"] == "int in [1, 65535]"
    assert cluster_rows["roles.trainer"]["expected"] == "a table or a list of tables"
    assert cluster_rows["roles.trainer.gpus"]["expected"] == "a list of int >= 0"
    assert all(r["help"] for r in rows.values())


def test_role_restarts_are_counted_within_ten_minutes_so_a_long_run_survives_rare_kills(
        monkeypatch) -> None:
    """role_max_restarts deaths within ENGINE_RESTART_WINDOW_S end the run (a crash loop); the
    same number spread over a long run do not (a worker killed once an hour goes on)."""
    from types import SimpleNamespace

    from rollmesh.launcher import launcher as launcher_module
    from rollmesh.launcher.launcher import ENGINE_RESTART_WINDOW_S, Launcher

    clock = [1000.0]
    monkeypatch.setattr(launcher_module.time, "monotonic", lambda: clock[0])
    fake = SimpleNamespace(deaths={}, cluster=SimpleNamespace(role_max_restarts=2))
    assert Launcher.may_restart(fake, "agent_worker[0]")
    assert Launcher.may_restart(fake, "agent_worker[0]")
    assert not Launcher.may_restart(fake, "agent_worker[0]")  # a third death within the window
    assert Launcher.may_restart(fake, "agent_worker[1]")  # each process has its own count
    for _ in range(10):  # one death an hour: always restarted
        clock[0] += ENGINE_RESTART_WINDOW_S * 6
        assert Launcher.may_restart(fake, "rollouter[0]")
