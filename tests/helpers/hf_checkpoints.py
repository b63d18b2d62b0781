"""Hugging Face checkpoint directories of real architectures, written at test time.

Each is what `save_pretrained` writes for a real model — config.json, safetensors (sharded
where asked), generation_config.json, and a fast tokenizer with that family's special tokens
and chat template — at tiny shapes with random weights, so tests load them through the same
code paths a downloaded Qwen2.5 / Qwen3 / Llama-3.1 / Gemma2 checkpoint takes. The tokenizer's
vocabulary is the tiny byte-level BPE (rollmesh/models/assets/tokenizer.json) plus the
family's special tokens; the chat templates are the families' own (Qwen2.5-Instruct's with
tools, Qwen3's with tools and thinking, Llama-3.1-Instruct's with tools).

    write_checkpoint("qwen2.5", tmp_path / "qwen")   # -> the directory
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollmesh.models.loading import TOKENIZER_FILE

# Qwen2.5-Instruct's tokenizer_config.json chat_template, verbatim.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's: tools, <think> blocks kept only after the last user query, enable_thinking.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama-3.1-Instruct's (JSON tool calls; tools in the first user message by default).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma2's (no system role; turns end with <end_of_turn>).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_EXTRA = ["<tool_call>", "</tool_call>"]  # added, not special: decoded with the text
QWEN3_EXTRA = [*QWEN_EXTRA, "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


@dataclass(frozen=True)
class Family:
    """One architecture family: its config class, special tokens and chat template."""

    config: str  # transformers config class name
    template: str
    special: list[str]
    bos: str | None
    eos: str  # the chat model's end of turn (tokenizer.eos_token)
    pad: str
    extra: list[str] = field(default_factory=list)
    generation_eos: list[str] = field(default_factory=list)  # generation_config.eos_token_id
    config_kw: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen2.5": Family("Qwen2Config", QWEN25_TEMPLATE, QWEN_SPECIAL, None, "<|im_end|>",
                      "<|endoftext|>", QWEN_EXTRA, ["<|im_end|>", "<|endoftext|>"],
                      {"use_sliding_window": False}),
    "qwen3": Family("Qwen3Config", QWEN3_TEMPLATE, QWEN_SPECIAL, None, "<|im_end|>",
                    "<|endoftext|>", QWEN3_EXTRA, ["<|im_end|>", "<|endoftext|>"],
                    {"head_dim": 16}),
    "llama3.1": Family("LlamaConfig", LLAMA31_TEMPLATE, LLAMA_SPECIAL, "<|begin_of_text|>",
                       "<|eot_id|>", "<|end_of_text|>", [],
                       ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                       {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 128}}),
    "gemma2": Family("Gemma2Config", GEMMA2_TEMPLATE, GEMMA_SPECIAL, "<bos>", "<end_of_turn>",
                     "<pad>", [], ["<eos>", "<end_of_turn>"],
                     {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                      "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
}


def build_tokenizer(family: str) -> Any:
    """The tiny BPE with `family`'s special tokens, BOS handling and chat template."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[family]
    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    tok.add_special_tokens([t for t in f.special if tok.token_to_id(t) is None])
    if f.extra:
        tok.add_tokens(f.extra)
    if f.bos is not None:  # Llama and Gemma prepend BOS to every encoded text
        tok.post_processor = processors.TemplateProcessing(
            single=f"{f.bos} $A", pair=f"{f.bos} $A {f.bos} $B",
            special_tokens=[(f.bos, tok.token_to_id(f.bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f.bos, eos_token=f.eos, pad_token=f.pad,
        additional_special_tokens=[t for t in f.special if t not in (f.bos, f.eos, f.pad)],
        chat_template=f.template, model_max_length=512, clean_up_tokenization_spaces=False)


def build_model(family: str, tokenizer: Any, *, tied: bool, seed: int = 0,
                pad_vocab_to: int = 64) -> Any:
    """A random `family` model at tiny shapes; its vocabulary padded up to a multiple of
    `pad_vocab_to`, as real checkpoints pad theirs (Qwen2.5: 151936 rows for 151665 tokens)."""
    import transformers

    f = FAMILIES[family]
    vocab = -(-len(tokenizer) // pad_vocab_to) * pad_vocab_to
    ids = [tokenizer.convert_tokens_to_ids(t) for t in f.generation_eos]
    config = getattr(transformers, f.config)(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied, eos_token_id=ids if len(ids) > 1 else ids[0],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        dtype="float32", **f.config_kw)
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:  # random init is small: widen the logits so greedy is not flat
                    p.mul_(4.0)
                elif "norm" in name:  # norms of random sign, as trained ones are not all 1:
                    p.normal_()  # with tied embeddings, h . E^T would favour the last token
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model.eval()


def write_checkpoint(family: str, path: str | Path, *, tied: bool = False, seed: int = 0,
                     max_shard_size: str | None = None) -> Path:
    """`family` as a checkpoint directory at `path` (safetensors in shards of
    `max_shard_size`, e.g. "100KB", when given; one file otherwise)."""
    path = Path(path)
    tokenizer = build_tokenizer(family)
    model = build_model(family, tokenizer, tied=tied, seed=seed)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    tokenizer.save_pretrained(path)
    return path


REMOTE_CONFIG = '''from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "rollmesh_remote"
'''
REMOTE_MODELING = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    """The checkpoint's own code: transformers runs it only with trust_remote_code."""

    config_class = RemoteConfig
'''


def write_remote_code_checkpoint(path: str | Path) -> Path:
    """A Qwen2.5 checkpoint whose config.json names its own modelling code (`auto_map`), as
    checkpoints of architectures transformers does not ship do."""
    import json

    path = write_checkpoint("qwen2.5", path)
    (path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (path / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="rollmesh_remote", architectures=["RemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
