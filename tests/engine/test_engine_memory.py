"""The built-in engine gives memory back and takes it again as SGLang 0.5.23 does
(/release_memory_occupation, /resume_memory_occupation; colocated mode): SGLang's bodies and
answers (tests/fixtures/sglang), its idle rule, requests held while released and served after,
weight updates refused while the weights are away, and the same greedy output afterwards."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from engine_harness import Engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.timeout(300)


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _generate_in_thread(e: Engine, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        result["r"] = e.post("/generate", body)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def test_memory_is_given_back_and_taken_again_as_sglang_does(tmp_path):
    e = Engine(tmp_path / "engine.log")
    try:
        prompt = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": GREEDY}
        status, before = e.post("/generate", prompt)
        assert status == 200, before

        # SGLang's bodies and answers (JSON null), in order: release then resume
        for name in ("release_memory_occupation", "resume_memory_occupation"):
            fx = load(name)
            assert e.post(fx["path"], fx["request"]) == (fx["status"], fx["response"]), name
        assert e.stats()["memory_released"] == []

        # what cannot be done is a 400 in SGLang's error form, naming why
        status, reply = e.post("/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "not released" in reply["error"]["message"], reply
        status, reply = e.post("/release_memory_occupation", {"tags": ["gpu"]})
        assert status == 400 and "tags" in json.dumps(reply), reply

        # everything released (no tags = all three, GET as well as POST): a /generate waits
        assert e.get("/release_memory_occupation") == (200, None)
        assert e.stats()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
        assert e.get("/health_generate")[0] == 200  # alive, only holding
        t, held = _generate_in_thread(e, prompt)
        time.sleep(1.5)
        assert t.is_alive() and e.stats()["waiting_requests"] == 1, held
        status, reply = e.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert status == 400 and "released" in reply["message"], reply
        assert e.post("/resume_memory_occupation", {"tags": None}) == (200, None)
        t.join(60)
        status, after = held["r"]
        assert status == 200 and after["output_ids"] == before["output_ids"], after

        # a busy engine refuses (SGLang asserts it is idle), and goes on generating
        long = {"input_ids": [5, 6, 7], "rid": "long",
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        t, busy = _generate_in_thread(e, long)
        deadline = time.monotonic() + 60
        while e.stats()["running_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        fx = load("release_memory_occupation_busy")
        assert e.post(fx["path"], fx["request"]) == (fx["status"], fx["response"])
        assert e.stats()["memory_released"] == []
        e.post("/abort_request", {"rid": "long"})
        t.join(60)
        assert busy["r"][0] == 200
        assert busy["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        e.stop()
