"""Bad requests get a 4xx with a JSON message, and the engine keeps serving."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import json

import pytest
from engine_harness import Engine

from rollmesh.engine.client import error_message

pytestmark = pytest.mark.slow

GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def _with(**changes):
    body = {"input_ids": GOOD["input_ids"], "sampling_params": dict(GOOD["sampling_params"])}
    for key, value in changes.items():
        if key.startswith("sp_"):
            body["sampling_params"][key[3:]] = value
        elif value is None:
            body.pop(key)
        else:
            body[key] = value
    return body


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (_with(input_ids=None), "input_ids"),
        (_with(text="hello"), "exactly one of text or input_ids"),
        (_with(input_ids=None, text=[]), "the batch is empty"),
        (_with(sp_foo=1), "unknown field 'foo'"),
        (_with(sp_max_new_tokens=-1), "max_new_tokens"),
        (_with(input_ids=[5] * 4100), "longer than the model's context length"),
        (_with(sp_max_new_tokens=4093), "maximum context length"),
        (_with(input_ids=[5, "6"]), "not an integer"),
        (_with(input_ids=[5, 1.5]), "not an integer"),
        (_with(input_ids=[5, 2048]), "outside the vocabulary"),
        (_with(input_ids=[-1]), "outside the vocabulary"),
        (_with(input_ids=[]), "prompt is empty"),
        (_with(sp_n=0), "sampling_params.n must be >= 1"),
        # issue 35: n = 2,000,000 reached 8 GB and queued 2M requests; a 60 MB text prompt
        # was tokenized (101 s) before its length was checked
        (_with(sp_n=2_000_000), "over this engine's limit of 4096 per call"),
        (_with(input_ids=[[5]] * 3, sp_n=1366), "4098 requests"),
        (_with(input_ids=None, text="a" * 300_000), "refused before tokenizing"),
        (_with(sp_repetition_penalty=2.5), "repetition_penalty must be in (0, 2]"),
        (_with(sp_frequency_penalty=-3), "frequency_penalty"),
        (_with(sp_logit_bias={"5000": 1.0}), "logit_bias"),
        (_with(sp_custom_params="x"), "custom_params"),
        (_with(input_ids=[[5, 6], []]), "prompt is empty (prompt 1 of the batch)"),
        (_with(input_ids=[[5, 6], 7]), "list of lists"),
        (_with(input_ids=None, text=["a", 3]), "text must be a string or a list of strings"),
        (_with(input_ids=[[5], [6]], rid=["a"]), "2 prompts"),
        (_with(input_ids=[[5], [6]], rid=["a", "a"]), "Duplicate request IDs"),
        (_with(rid=["a"]), "rid must be a string"),
        (_with(return_logprob=True, logprob_start_len=3), "logprob_start_len (3)"),
        (_with(return_logprob=True, logprob_start_len=-2), "logprob_start_len must be >= -1"),
        (_with(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
        (_with(return_logprob=True, top_logprobs_num="3"), "top_logprobs_num"),
        (_with(return_text_in_logprobs=1), "return_text_in_logprobs"),
        (_with(token_ids_logprob=[5]), "token_ids_logprob is not supported"),
        (_with(image_data="x.png"), "image_data is not supported"),
        (_with(lora_path="a"), "was requested, but LoRA is not enabled"),
        (_with(lora_path=5), "lora_path must be a string"),
        (_with(lora_id="a"), "lora_id is not supported"),
        (_with(custom_logit_processor="{}"), "custom_logit_processor is not supported"),
        (_with(sp_temperature=-0.5), "temperature"),
        (_with(sp_top_p=0), "top_p"),
        (_with(sp_top_k=0), "top_k"),
        (_with(sp_stop_token_ids=[99999]), "stop_token_ids"),
        (_with(sp_regex="a+"), "not supported"),
        (_with(sampling_params=[1]), "sampling_params"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_generate_is_refused_and_the_engine_keeps_serving(engine, body, needle):
    status, reply = engine.post("/generate", body)
    assert 400 <= status < 500
    # SGLang's shapes: {"error": {"message": ...}}, or for a body that is no JSON object,
    # FastAPI validation's {"object": "error", "message": ...}
    assert isinstance(reply.get("error"), dict) or reply.get("object") == "error", reply
    assert needle in error_message(json.dumps(reply)), reply
    status, reply = engine.post("/generate", GOOD)
    assert status == 200 and len(reply["output_ids"]) == 3


def test_malformed_json(engine):
    for raw in (b"{not json", b"", b"\xff\xfe"):
        status, reply = engine.post("/generate", raw=raw)
        assert status == 400 and reply["object"] == "error" and reply["code"] == 400
        assert "JSON" in reply["message"]
    assert engine.post("/generate", GOOD)[0] == 200


def test_json_nested_100k_deep_is_a_400_on_every_route(engine):
    """It answered 500 (an uncaught RecursionError in the JSON parser)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        status, reply = engine.post(path, raw=deep)
        assert status == 400 and "nested too deeply" in json.dumps(reply), (path, reply)
    assert engine.post("/generate", GOOD)[0] == 200


def test_bad_control_requests(engine):
    status, _ = engine.post("/pause_generation", {"mode": "sideways"})
    assert status == 400
    status, reply = engine.post("/update_weights_from_distributed",
                                {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                 "group_name": "nope"})
    assert status == 400 and reply["success"] is False
    status, reply = engine.post("/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert status == 400 and reply["success"] is False
    status, reply = engine.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "backend": "nccl"})
    assert status == 400 and "gloo" in reply["message"]
    assert engine.post("/generate", GOOD)[0] == 200


def test_bad_model_spec_exits_with_a_message(tmp_path):
    with pytest.raises(RuntimeError, match="unknown key 'widht'"):
        Engine(tmp_path / "engine.log", model="tiny:widht=3")


def test_sigterm_answers_in_flight_requests_and_exits_cleanly(tmp_path):
    e = Engine(tmp_path / "engine.log")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3000,
                                                        "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(e.post, "/generate", body)
        while e.stats()["running_requests"] == 0:
            time.sleep(0.02)
        e.proc.send_signal(signal.SIGTERM)
        status, reply = pending.result(timeout=30)
    assert status == 503 and reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(reply["output_ids"]) > 0
    assert e.proc.wait(30) == 0
    assert "engine_stopped" in e.log()
