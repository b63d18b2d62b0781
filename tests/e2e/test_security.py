"""End-to-end tests of security (they start processes); the unit tests and the
helpers they share are in tests/unit/test_security.py."""

from __future__ import annotations

import asyncio

import pytest

from rollmesh.launcher.supervisor import Supervisor
from rollmesh.wire.messages import Metrics
from rollmesh.wire.transport import (
    CurveKeys,
    RpcClient,
    Transport,
    free_port,
)
from tests.unit.test_security import ENV, first_handshake, launcher_keys


@pytest.mark.slow
@pytest.mark.parametrize("bind", ["*", "127.0.0.1"], ids=["every_interface", "loopback"])
def test_a_role_refuses_clients_without_the_runs_keys(tmp_path, monkeypatch, bind):
    """On every interface, and on loopback too (issue 35, item 3: on one host the role sockets
    were plain TCP, and a local process without keys, model code among them, registered a fake
    reward worker, took batches, sent WeightVersion and StopRun)."""
    run_dir, keys = launcher_keys(tmp_path, monkeypatch)
    _, other = launcher_keys(tmp_path / "other", monkeypatch)
    # Knows the server's public key (it is no secret) but has a key pair of its own.
    impostor = CurveKeys(keys.server_public, b"", other.client_public, other.client_secret,
                         other.directory)

    async def main():
        with Transport(keys) as t:  # (the launcher holds the run's keys, as the roles do)
            sup = Supervisor(t, heartbeat_s=0.5, liveness=6, log_dir=tmp_path / "logs",
                             keys_dir=str(keys.directory))
            # the role's transport holds the run's keys: CURVE on either address
            port = free_port("0.0.0.0" if bind == "*" else bind)
            child = sup.spawn("echo", "tests.helpers.roles:echo", env=ENV,
                              config={"bind": f"tcp://{bind}:{port}"})
            try:
                address = (await sup.wait_ready(child, 60))["rpc"]
                target = f"tcp://127.0.0.1:{address.rsplit(':', 1)[1]}"
                # Each client's handshake must fail: without keys (a plain client), with a key
                # pair of its own and another server key, and the impostor's (ZAP says 400).
                outcomes = {}
                for who, transport in (("no keys", Transport()),
                                       ("wrong client key", Transport(other)),
                                       ("impostor", Transport(impostor))):
                    with transport:
                        outcomes[who] = await first_handshake(transport, target,
                                                              secure=who != "no keys")
                assert all(o.startswith("failed") for o in outcomes.values()), outcomes
                assert outcomes["impostor"] == "failed (auth)", outcomes  # its key, by ZAP
                with Transport(keys) as good:
                    client = RpcClient(good, target, timeout_s=10, secure=True)
                    try:
                        reply = await client.request(Metrics(role="t", host="h", values={}))
                    finally:
                        client.close()
                # The echo role answers Metrics with its server's counters: it saw the one
                # request that got through the handshake, and nothing from the three refused.
                assert isinstance(reply, Metrics) and reply.values["requests"] == 1
            finally:
                await sup.close(grace_s=5)

    asyncio.run(main())


@pytest.mark.slow
def test_engine_http_needs_the_runs_api_key(tmp_path):
    """Every route but /health needs `Authorization: Bearer <key>`: without it anyone who
    reaches the port could point the engine at their own weight-update group."""
    import json as _json
    import urllib.error
    import urllib.request

    from tests.engine.engine_harness import Engine

    key_file = tmp_path / "engine.key"
    key_file.write_text("s3cret-run-key\n")
    key_file.chmod(0o600)
    engine = Engine(tmp_path / "engine.log", "--api-key-file", str(key_file))
    try:
        def call(path: str, token: str | None, body: dict | None = None) -> int:
            headers = {"Content-Type": "application/json"}
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            data = None if body is None else _json.dumps(body).encode()
            req = urllib.request.Request(engine.url + path, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        # liveness probes stay open: every /health* path, as SGLang's decide_request_auth
        assert call("/health", None) == 200
        assert call("/health_generate", None) == 200
        for path, body in (("/get_model_info", None), ("/generate", {"input_ids": [1, 2],
                           "sampling_params": {"max_new_tokens": 2}}),
                           ("/init_weights_update_group", {"master_address": "10.0.0.1",
                            "master_port": 1, "rank_offset": 1, "world_size": 2,
                            "group_name": "evil", "backend": "gloo"})):
            assert call(path, None, body) == 401, path
            assert call(path, "wrong-key", body) == 401, path
        assert call("/get_model_info", "s3cret-run-key") == 200
        assert call("/generate", "s3cret-run-key",
                    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) == 200
    finally:
        engine.stop()

    # a key file others can read is refused at start, naming the file and the fix
    key_file.chmod(0o644)
    with pytest.raises(RuntimeError, match="must not be readable by group or others"):
        Engine(tmp_path / "engine2.log", "--api-key-file", str(key_file))


@pytest.mark.slow
def test_a_generating_roles_engine_key_cannot_move_the_weights_or_the_version(tmp_path):
    """Issue 35: every role that talked to the engines held the one engine token, so a
    rollouter or an agent worker (whatever ran in it) could call /update_weight_version or
    join a weight-update group of its own. With the run's two keys, as the launcher writes
    them and each role loads its own, the agent worker's key generates and is refused every
    admin route; the trainer's moves the version; the admin key does not open /generate."""
    from rollmesh.engine.auth import EngineKeys
    from rollmesh.engine.client import EngineClient, EngineRequestError
    from tests.engine.engine_harness import Engine

    keys = tmp_path / "keys"
    keys.mkdir()
    EngineKeys.for_run(keys, resume=False).write(keys)
    engine = Engine(tmp_path / "engine.log", "--weight-version", "0",
                    "--api-key-file", str(keys / "engine.token"),
                    "--admin-api-key-file", str(keys / "engine-admin.token"))
    agent, trainer = EngineKeys.load(str(keys)), EngineKeys.load(str(keys), admin=True)
    attacks = {
        "/update_weight_version": {"new_version": "1000000", "abort_all_requests": False},
        "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1,
                                       "rank_offset": 1, "world_size": 2,
                                       "group_name": "evil", "backend": "gloo"},
        "/update_weights_from_disk": {"model_path": "tiny:seed=9"},
        "/abort_request": {"rid": "", "abort_all": True},
        "/pause_generation": {"mode": "abort"},
        "/release_memory_occupation": {},
        "/load_lora_adapter": {"lora_name": "evil", "lora_path": "/tmp/evil"},
        "/flush_cache": {},
    }

    async def main():
        refused = {}
        async with EngineClient([engine.url], api_key=agent.api, admin_key=agent.admin) as c:
            out = await c.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})
            for path, body in attacks.items():
                try:
                    await c._call(c.servers[0], "POST", path, body, 30)
                    refused[path] = "served"
                except EngineRequestError as e:
                    refused[path] = e.status
            version = (await c.server_info())[0]["weight_version"]
        # the admin key alone opens no generation (as SGLang: each key its own routes)
        async with EngineClient([engine.url], api_key=trainer.admin) as c:
            with pytest.raises(EngineRequestError, match="401"):
                await c.generate([1, 2, 3], {"max_new_tokens": 3})
        async with EngineClient([engine.url], api_key=trainer.api,
                                admin_key=trainer.admin) as c:
            await c.update_weight_version("1")
            after = (await c.server_info())[0]["weight_version"]
        return out, refused, version, after

    try:
        out, refused, version, after = asyncio.run(main())
    finally:
        engine.stop()
    assert len(out.output_ids) == 3
    assert refused == {path: 401 for path in attacks}, refused
    assert version == "0" and after == "1"
