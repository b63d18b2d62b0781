"""Security rules, checked on the real thing.

(a) CURVE: a role's socket on a non-loopback address refuses a client without the run's keys
    (no keys, or a key pair of its own that knows the server's public key) and serves one with
    them; which addresses get CURVE is decided by `transport.is_loopback`.
(b) The launcher writes the run's keys private: key directory 0700, key files 0600.
(c) No pickle-family deserialisation anywhere in the package (an AST scan, file:line).
(d) The monitor only subscribes: its one socket is a SUB, and nothing a subscriber of the hub
    sends reaches the other subscribers or the roles; a role publishes only its own topics.
(e) SSH keeps host-key checking on and never prompts (BatchMode), whatever ssh_options say.
(f) Every role process holds a key pair of its own, and each socket takes from each role only
    the messages that role may send (issue 35, item 3): the attacks a local process made on a
    run, now made with the keys of a role that may not.
(g) The engines' HTTP takes two keys, as SGLang's --api-key and --admin-api-key: the roles that
    generate hold the first only, and cannot move an engine's weights or version.
"""

from __future__ import annotations

import ast
import asyncio
import os
import stat
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from rollmesh import config as C
from rollmesh.config import ConfigError, HostConfig, load_cluster, parse_config
from rollmesh.launcher.hosts import SshHost
from rollmesh.wire.protocol import encode
from rollmesh.wire.messages import Metrics, StatsRequest
from rollmesh.wire.transport import (
    CurveKeys,
    Transport,
    TransportError,
    is_loopback,
)
from rollmesh.wire.channels import Publisher, StatusProxy

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def launcher_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, CurveKeys]:
    """A run directory made by the launcher itself (launch/local.toml), and its keys."""
    from rollmesh.launcher.launcher import Launcher

    monkeypatch.chdir(ROOT)  # the cluster file's paths are relative to the repo root
    cluster = load_cluster(ROOT / "launch/local.toml")
    run_dir = tmp_path / "run"
    keys = Launcher(cluster, run_dir, echo=False).prepare_run_dir()
    return run_dir, keys


# -- (a) CURVE -------------------------------------------------------------------------------


HANDSHAKE_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed (protocol)",
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed (auth)"}


async def first_handshake(transport: Transport, target: str, secure: bool,
                          timeout_s: float = 60) -> str:
    """How the first handshake of a client on `transport` with `target` ends, a request sent
    on it meanwhile: "succeeded" or "failed ...", as the client's socket reports it. Waited for
    as long as it takes (a loaded machine), not judged by a reply missing after a while."""
    sock = transport.socket(zmq.DEALER, connect=target, secure=secure, linger_ms=0)
    events = sock.get_monitor_socket(sum(HANDSHAKE_EVENTS))
    try:
        await sock.send_multipart([b"\x00" * 7 + b"\x01", *encode(StatsRequest())])
        event = parse_monitor_message(await asyncio.wait_for(events.recv_multipart(), timeout_s))
        return HANDSHAKE_EVENTS[event["event"]]
    finally:
        sock.disable_monitor()
        events.close(0)
        sock.close(0)


@pytest.mark.parametrize("address,curve", [
    ("tcp://127.0.0.1:0", False), ("tcp://localhost:0", False), ("tcp://[::1]:0", False),
    ("ipc:///tmp/rollmesh-x", False), ("tcp://*:0", True), ("tcp://0.0.0.0:0", True),
    ("tcp://192.0.2.2:0", True), ("tcp://gpu-node-3:0", True), ("tcp://eth0:0", True),
])
def test_with_the_runs_keys_every_socket_is_curve_and_without_non_loopback_is_refused(
        tmp_path, address, curve):
    """A process holding the run's keys makes every socket CURVE, loopback included (issue 35,
    item 3: on one host a local process without keys drove the roles' plain sockets); one
    without keys makes loopback sockets plain and refuses the others."""
    assert is_loopback(address) is not curve
    keys = CurveKeys.generate(tmp_path / "keys")
    # Wildcards can only be bound; the others are connected (no peer or network needed).
    how = "bind" if address.startswith(("tcp://*", "tcp://0.0.0.0")) else "connect"
    target = address if how == "bind" else address.replace(":0", ":9")
    with Transport(keys) as t:
        sock = t.socket(zmq.ROUTER, **{how: target})
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert bool(sock.curve_server) is (how == "bind")
        sock.close(0)
    with Transport() as t:  # no keys: refused where CURVE is due, plain TCP otherwise
        if curve:
            with pytest.raises(TransportError, match="CURVE keys are required"):
                t.socket(zmq.ROUTER, **{how: target})
        else:
            sock = t.socket(zmq.ROUTER, **{how: target})
            assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
            sock.close(0)


def test_the_launcher_binds_remote_roles_and_the_hub_with_curve():
    """The plan's bind addresses: loopback only on a single-host run; otherwise CURVE."""
    from rollmesh.launcher.plan import _bind
    from rollmesh.launcher.host_kinds import make_host

    local = make_host("a", HostConfig(address="127.0.0.1"))
    remote = make_host("b", HostConfig(address="10.1.2.3"))
    named = make_host("c", HostConfig(address="gpu-node-3", launch="ssh"))
    assert is_loopback(_bind(local, 5000))
    assert not is_loopback(_bind(remote, 5000)) and not is_loopback(_bind(named, 5000))
    src = (ROOT / "rollmesh/launcher/launcher.py").read_text()
    assert "StatusProxy(t, " in src and "secure=True)" in src.split("StatusProxy(t, ")[1][:120]


# -- (b) key files ----------------------------------------------------------------------------


def test_launcher_writes_private_keys(tmp_path, monkeypatch):
    run_dir, keys = launcher_keys(tmp_path, monkeypatch)
    key_dir = run_dir / "keys"
    assert keys.directory == key_dir
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    files = sorted(str(p.relative_to(key_dir)) for p in key_dir.rglob("*") if p.is_file())
    # one key pair per role process of launch/local.toml, the launcher's and the monitor's
    names = ["agent_worker-0", "agent_worker-1", "launcher", "message_queue-0", "monitor",
             "reward_worker-0", "rollouter-0", "synchronizer-0", "trainer-0"]
    assert files == ["clients/" + n + suffix for n in names for suffix in (".key", ".key_secret")
                     ] + ["engine-admin.token", "engine.token", "server.key", "server.key_secret"]
    for p in key_dir.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    # the run directory is the user's alone, and so is the resolved cluster file, which holds
    # `hosts.*.env` values (tokens a user puts there); it was world-readable (issue 35)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "cluster.toml").stat().st_mode) == 0o600
    # and a key directory that existed with loose modes is tightened
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    CurveKeys.generate(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


# -- (c) no pickle -----------------------------------------------------------------------------

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "jsonpickle",
                  "multiprocessing", "concurrent.futures.process"}
# multiprocessing is banned whole (its queues and pools pickle), but for these names, which read
# no pickle: a shared-memory segment and the tracker that unlinks it (sync by handle), and the
# pickler that WRITES SGLang's /update_weights_from_tensor payload (weight_sync/handles.py);
# ForkingPickler's loads, and anything else of multiprocessing, stay banned.
NOT_DESERIALISING = {"multiprocessing.shared_memory.SharedMemory",
                     "multiprocessing.resource_tracker",
                     "multiprocessing.resource_tracker.ensure_running",
                     "multiprocessing.reduction.ForkingPickler"}
BANNED_CALLS = {
    "marshal.load", "marshal.loads", "joblib.load", "pandas.read_pickle", "pd.read_pickle",
    "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all",
}
BANNED_METHODS = {  # on any object: pyzmq's pickle helpers, torch.distributed's object collectives
    "recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "recv_object_list",
    "send_object_list", "ProcessPoolExecutor",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def pickle_uses(source: str, filename: str) -> list[str]:
    """Every pickle-family deserialisation in `source`, as 'file:line: what'."""
    found = []
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module (import numpy as np)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name] = a.name
                if a.name in BANNED_MODULES or a.name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = full
                if full in NOT_DESERIALISING:
                    continue
                if (node.module in BANNED_MODULES or root in BANNED_MODULES
                        or full in BANNED_MODULES or a.name in BANNED_METHODS
                        or full in BANNED_CALLS):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        last = name.rsplit(".", 1)[-1]
        where = f"{filename}:{node.lineno}"
        if full in NOT_DESERIALISING:
            continue
        if (full in BANNED_CALLS or name in BANNED_CALLS or last in BANNED_METHODS
                or full.split(".")[0] in BANNED_MODULES):
            found.append(f"{where}: {name}()")
        elif full in ("torch.load",):
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append(f"{where}: torch.load() without weights_only=True")
        elif full in ("numpy.load",):
            ap = _kw(node, "allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                found.append(f"{where}: numpy.load(allow_pickle=...)")
        elif full in ("yaml.load", "yaml.load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader).rsplit(".", 1)[-1] not in ("SafeLoader",
                                                                            "CSafeLoader"):
                found.append(f"{where}: {name}() without SafeLoader")
    return found


def test_the_scanner_finds_each_banned_use():
    bad = """
import pickle
import numpy as np, torch, yaml, marshal, joblib
from cloudpickle import loads
import zmq
pickle.loads(b"")
np.load("x.npy", allow_pickle=True)
torch.load("x.pt")
torch.load("x.pt", weights_only=False)
yaml.load(text)
marshal.loads(b"")
joblib.load("x")
sock.recv_pyobj()
sock.send_pyobj(1)
torch.distributed.broadcast_object_list(objs)
from multiprocessing.reduction import ForkingPickler
ForkingPickler.loads(b"")
from multiprocessing import Queue
"""
    hits = pickle_uses(bad, "bad.py")
    assert sorted((h.split(":")[1] for h in hits), key=int) == [
        "2", "4", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "17", "18"]
    ok = """
import io
import numpy as np, torch, yaml
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.reduction import ForkingPickler
SharedMemory(name="rollmesh_w_1_1", create=True, size=8)
ForkingPickler(io.BytesIO()).dump([1])
np.load("x.npy")
np.load("x.npy", allow_pickle=False)
torch.load("x.pt", weights_only=True)
yaml.load(text, Loader=yaml.SafeLoader)
yaml.safe_load(text)
"""
    assert pickle_uses(ok, "ok.py") == []


def test_no_pickle_family_deserialisation_in_the_package():
    files = sorted((ROOT / "rollmesh").rglob("*.py"))
    assert len(files) > 30
    found = []
    for path in files:
        found += pickle_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "pickle-family deserialisation:\n" + "\n".join(found)


# -- (d) the monitor is read-only ---------------------------------------------------------------

SENDING = {"PUB", "PUSH", "DEALER", "ROUTER", "REQ", "REP", "PAIR", "XPUB", "XSUB", "STREAM"}


def test_the_monitor_only_subscribes_in_its_source():
    tree = ast.parse((ROOT / "rollmesh/observe/monitor.py").read_text())
    zmq_types = {n.attr for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and _dotted(n.value) == "zmq"}
    assert not zmq_types & SENDING, zmq_types & SENDING
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    from rollmesh.wire import channels as transport
    senders = {"Publisher", "Pusher", "RpcClient", "RpcServer", "Channel", "ChannelClient",
               "StatusProxy", "Puller"}
    assert hasattr(transport, "Subscriber") and not names & senders, names & senders
    assert ".socket(" not in (ROOT / "rollmesh/observe/monitor.py").read_text()


def test_the_hub_passes_nothing_from_a_subscriber_to_the_run(tmp_path):
    """The monitor's HubLink holds one SUB socket. Whatever a hostile subscriber with the keys
    sends into the hub's XPUB side (raw messages from an XSUB, or any frames from a socket type
    the XPUB does not pair with) reaches neither the monitor nor the publishing roles; the hub
    keeps forwarding the roles' status."""
    from rollmesh.observe.monitor import HubLink, Run, StatusBoard

    keys = CurveKeys.generate(tmp_path / "keys", ["monitor", "launcher", "rollouter-0",
                                                  "reward_worker-0"])

    async def main():
        with as_(keys.directory, "launcher") as t:
            hub = StatusProxy(t, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", secure=True)
            run = Run(name="t", run_dir=tmp_path, hub=hub.backend, keys_dir=keys.directory,
                      launcher_pid=None)
            board = StatusBoard(run)
            link = HubLink(run, keys, board)
            assert link.sub.sock.type == zmq.SUB
            role = as_(keys.directory, "rollouter-0")
            pub = Publisher(role, hub.frontend, secure=True)
            # a role's key publishes its own topics only (per-role keys, issue 35)
            other_role = as_(keys.directory, "reward_worker-0")
            forger = Publisher(other_role, hub.frontend, secure=True)
            # What the role's PUB socket receives from upstream: only subscriptions may arrive.
            hostile = Transport(keys)
            xsub = hostile.socket(zmq.XSUB, connect=hub.backend, secure=True, sync=True)
            dealer = hostile.socket(zmq.DEALER, connect=hub.backend, secure=True, sync=True)
            try:
                deadline = time.monotonic() + 20
                while not board.received and time.monotonic() < deadline:
                    await pub.publish("metrics.rollouter.0",
                                      Metrics(role="rollouter", host="h", values={"seq": 1}))
                    await asyncio.sleep(0.1)
                assert board.received, "no status through the hub"
                forged = [b"metrics.trainer.0",
                          *encode(Metrics(role="trainer", host="evil", values={"step": 666}))]
                for _ in range(20):
                    await forger.publish("metrics.trainer.0", Metrics(
                        role="trainer", host="evil", values={"step": 666}))
                    xsub.send_multipart(forged)  # not a subscription: must go nowhere useful
                    xsub.send(b"\x02garbage")
                    dealer.send_multipart(forged, flags=zmq.NOBLOCK) if dealer.poll(
                        0, zmq.POLLOUT) else None
                for i in range(10):
                    await pub.publish("metrics.rollouter.0",
                                      Metrics(role="rollouter", host="h", values={"seq": 2 + i}))
                    await asyncio.sleep(0.05)
                deadline = time.monotonic() + 10  # (its connection may come up late)
                while hub.forbidden == 0 and time.monotonic() < deadline:
                    await forger.publish("metrics.trainer.0", Metrics(
                        role="trainer", host="evil", values={"step": 666}))
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                snap = board.snapshot()
                text = repr(snap)
                assert "evil" not in text and "666" not in text
                assert link.sub.protocol_errors == 0
                assert board._values("rollouter")["seq"] >= 2  # the hub still forwards status
                assert hub.forbidden > 0  # the forger's publications reached it and were dropped
            finally:
                xsub.close(0)
                dealer.close(0)
                pub.close()
                role.close()
                forger.close()
                other_role.close()
                hostile.close()
                await link.close()
                hub.close()

    asyncio.run(main())


# -- (e) SSH -----------------------------------------------------------------------------------


def test_ssh_keeps_host_key_checking_and_batch_mode(tmp_path):
    cfg = parse_config(HostConfig, {"address": "gpu-node-3", "user": "rl", "port": 2222,
                                    "ssh_options": ["UserKnownHostsFile=/etc/rl/known_hosts",
                                                    "BatchMode=no"]}, "test")
    argv = SshHost("gpu", cfg, control_dir=tmp_path).ssh()
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert argv[0] == "ssh" and argv[-1] == "gpu-node-3"
    # ssh takes the first value it reads for an option: BatchMode=yes comes before the user's.
    assert opts[0] == "BatchMode=yes" and opts.index("BatchMode=yes") < opts.index("BatchMode=no")
    assert not [o for o in opts if o.lower().replace(" ", "").startswith(
        ("stricthostkeychecking=no", "stricthostkeychecking=off", "stricthostkeychecking=accept"))]
    assert not any("StrictHostKeyChecking" in a for a in argv)  # left as ssh_config has it: on
    assert "UserKnownHostsFile=/dev/null" not in opts


@pytest.mark.parametrize("opt", ["StrictHostKeyChecking=no", "stricthostkeychecking no",
                                 " StrictHostKeyChecking = accept-new", "StrictHostKeyChecking\tno"])
def test_ssh_options_cannot_turn_host_key_checking_off(opt):
    with pytest.raises(ConfigError) as err:
        parse_config(HostConfig, {"address": "gpu-node-3", "ssh_options": ["Compression=yes", opt]},
                     "c.toml")
    assert str(err.value) == ("c.toml: ssh_options[1]: host-key checking stays on: add the host's "
                              "key to a known_hosts file instead")


def test_engine_http_binds_loopback_by_default():
    from rollmesh.engine.builtin.server import _parser

    assert _parser().parse_args(["--model", "tiny", "--port", "1"]).host == "127.0.0.1"
    assert C.HostConfig  # the config module is the one the launcher uses
    assert os.environ.get("ROLLMESH_ENGINE_HOST") is None


# -- (g) the engines' HTTP: two keys ----------------------------------------------------------


def test_engine_routes_take_the_keys_sglang_gives_them():
    """rollmesh.engine.auth.decide against SGLang 0.5.23's decide_request_auth, case by case:
    an admin route takes the admin key only where one is set (the API key no longer opens it),
    any other route the API key only (the admin key does not open /generate), probes none."""
    from rollmesh.engine.auth import decide, is_admin, key_for

    api, admin = "A", "Z"
    bearer = {None: None, "api": f"Bearer {api}", "admin": f"Bearer {admin}",
              "wrong": "Bearer nope", "scheme": f"Basic {api}"}
    # (keys set, route) -> the headers that pass
    expected = {
        ("both", "/update_weight_version"): {"admin"},
        ("both", "/abort_request"): {"admin"},
        ("both", "/pause_generation"): {"admin"},
        ("both", "/generate"): {"api"},
        ("both", "/get_server_info"): {"api"},
        ("both", "/health"): set(bearer),
        ("api only", "/update_weight_version"): {"api"},
        ("api only", "/generate"): {"api"},
        ("admin only", "/update_weight_version"): {"admin"},
        ("admin only", "/generate"): set(bearer),  # SGLang leaves normal routes open then
        ("none", "/update_weight_version"): set(bearer),
    }
    keys = {"both": (api, admin), "api only": (api, None), "admin only": (None, admin),
            "none": (None, None)}
    for (which, path), passing in expected.items():
        got = {h for h, value in bearer.items() if decide("POST", path, value, *keys[which])}
        assert got == passing, (which, path, got)
    assert decide("OPTIONS", "/update_weight_version", None, api, admin)  # as SGLang
    assert is_admin("/dumper/start") and not is_admin("/v1/chat/completions")
    # a client sends what each route takes: a trainer's holds both, a worker's the API key
    assert key_for("/update_weights_from_distributed", api, admin) == admin
    assert key_for("/generate", api, admin) == api
    assert key_for("/update_weight_version", api, None) == api


def test_every_weight_route_of_the_builtin_engine_is_an_admin_route():
    """Whatever the built-in engine serves that changes its weights, version, adapter, memory
    or what runs is an admin route (a route added later without it would be open to every
    role that generates)."""
    from rollmesh.engine import auth
    from rollmesh.engine.builtin.server import EngineServer, _parser
    from rollmesh.models.loading import build_tiny
    from rollmesh.runtime.log import get_logger

    model, tok = build_tiny("tiny")
    args = _parser().parse_args(["--model", "tiny", "--port", "0"])
    app = EngineServer(args, model, tok, get_logger("rollmesh.engine")).app()
    paths = {r.resource.canonical for r in app.router.routes()}
    changing = {p for p in paths if any(w in p for w in (
        "weight", "lora", "memory", "abort", "pause", "continue", "flush"))}
    changing -= {"/get_weight_version", "/weight_version"}  # reads
    assert changing and all(auth.is_admin(p) for p in changing), changing - {
        p for p in changing if auth.is_admin(p)}
    assert not any(auth.is_admin(p) for p in paths - changing)


def test_only_hosts_that_change_the_engines_get_their_admin_key(tmp_path):
    """An SSH host is sent the engines' admin key only where it runs an engine, a trainer or
    the synchronizer: a host of rollouters, agent or reward workers cannot send weights."""
    from types import SimpleNamespace

    from rollmesh.engine.auth import ADMIN_KEY_FILE, API_KEY_FILE, EngineKeys
    from rollmesh.launcher.keys import files_for_host, make_keys

    def planned(role: str, index: int, host: str):
        return SimpleNamespace(proc=SimpleNamespace(role=role, index=index, host=host))

    plan = [planned("engine", 0, "gpu"), planned("trainer", 0, "train"),
            planned("synchronizer", 0, "head"), planned("rollouter", 0, "head"),
            planned("agent_worker", 0, "cpu"), planned("reward_worker", 0, "cpu")]
    keys = tmp_path / "keys"
    make_keys(keys, plan, resume=False)
    EngineKeys.for_run(keys, resume=False).write(keys)
    given = {h: {f.name for f in files_for_host(keys, plan, h)}
             for h in ("gpu", "train", "head", "cpu")}
    for host in given:
        assert API_KEY_FILE in given[host], host
    assert {h for h in given if ADMIN_KEY_FILE in given[h]} == {"gpu", "train", "head"}
    assert "agent_worker-0.key_secret" in given["cpu"]


def test_the_engine_keys_of_a_run_are_private_and_a_resumed_run_keeps_them(tmp_path):
    from rollmesh.engine.auth import ADMIN_KEY_FILE, API_KEY_FILE, EngineKeys

    keys = tmp_path / "keys"
    keys.mkdir()
    made = EngineKeys.for_run(keys, resume=False)
    assert made.api and made.admin and made.api != made.admin
    made.write(keys)
    for name in (API_KEY_FILE, ADMIN_KEY_FILE):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    assert EngineKeys.for_run(keys, resume=True) == made
    assert EngineKeys.load(str(keys)) == EngineKeys(made.api, None)  # a generating role's
    assert EngineKeys.load(str(keys), admin=True) == made
    # a run made before there were two keys: its API key kept, an admin key made and written
    (keys / ADMIN_KEY_FILE).unlink()
    old = EngineKeys.for_run(keys, resume=True)
    assert old.api == made.api and old.admin not in (None, made.admin)
    old.write(keys)
    assert EngineKeys.load(str(keys), admin=True) == old


# -- (f) per-role authorisation ----------------------------------------------------------------

ROLE_KEYS = ["message_queue-0", "rollouter-0", "trainer-0", "synchronizer-0", "reward_worker-0",
             "agent_worker-0", "launcher", "monitor"]


def as_(directory: Path, identity: str) -> Transport:
    return Transport(CurveKeys.load(directory, identity))


def test_each_role_may_send_the_queue_only_its_own_messages(tmp_path):
    """The real queue's handlers behind a CURVE socket with `rollmesh.mq.role.ALLOW`. Item 3's
    attacks, now made with the key of a role that holds the run's keys but may not send them:
    groups scored by a fake reward worker, a batch taken by someone other than the trainer,
    `WeightVersion(10**9)` and `version=10**6` from anyone but the synchronizer. Each is
    answered `forbidden`, never reaches the queue, and is counted; the legitimate senders are
    served, and a key of another run does not even connect."""
    from rollmesh.mq.role import ALLOW, QueueRole
    from rollmesh.mq.store import MessageQueue
    from rollmesh.runtime.log import get_logger
    from rollmesh.wire.messages import (BatchCredit, OpenBatchStream, PutGroups, PutGroupsReply,
                                        WeightVersion)
    from rollmesh.wire.transport import (FORBIDDEN, PeerTimeout, RemoteError, RpcClient,
                                         RpcServer)
    from tests.unit.test_message_queue import group

    keys = tmp_path / "keys"
    CurveKeys.generate(keys, ROLE_KEYS)
    CurveKeys.generate(tmp_path / "other", ["synchronizer-0"])
    forbidden_before = FORBIDDEN["message queue"]

    async def main():
        role = QueueRole(MessageQueue(16, 2), log=get_logger("test"), host="h")
        transports = {n: as_(keys, n) for n in ROLE_KEYS}
        transports["other run"] = as_(tmp_path / "other", "synchronizer-0")
        server = RpcServer(transports["message_queue-0"], "tcp://127.0.0.1:0", role.handlers(),
                           allow=ALLOW, name="message queue")
        serving = asyncio.create_task(server.serve())
        clients = {n: RpcClient(t, server.address, timeout_s=5, retries=0)
                   for n, t in transports.items()}
        try:
            refused = {}
            for who, msg in (("reward_worker-0", PutGroups(groups=[group(1)])),
                             ("agent_worker-0", PutGroups(groups=[group(2)])),
                             ("reward_worker-0", WeightVersion(version=10**9)),
                             ("rollouter-0", WeightVersion(version=10**6)),
                             ("trainer-0", WeightVersion(version=10**6)),
                             ("agent_worker-0", OpenBatchStream(stream=1, groups=1, version=0,
                                                                next_step=1, through_step=9)),
                             ("monitor", BatchCredit(stream=1, version=0, through_step=9)),
                             ("launcher", PutGroups(groups=[group(3)]))):
                with pytest.raises(RemoteError) as e:
                    await clients[who].request(msg)
                refused[who, type(msg).__name__] = e.value
            assert all(e.code == "forbidden" for e in refused.values()), refused
            assert "reward_worker-0 may not send WeightVersion to the message queue (only " \
                   "synchronizer)" in str(refused["reward_worker-0", "WeightVersion"])
            assert role.queue.version == 0 and role.queue.depth_groups == 0
            assert server.stats.forbidden == 8
            assert FORBIDDEN["message queue"] - forbidden_before == 8
            # another run's key (with a role's name) fails the handshake: no reply at all
            with pytest.raises(PeerTimeout):
                await clients["other run"].request(WeightVersion(version=10**9), timeout_s=1)
            # the roles that may: the rollouter puts, the synchronizer moves the version, and
            # anybody of the run may ask for the stats
            reply = await clients["rollouter-0"].request(PutGroups(groups=[group(4)]))
            assert isinstance(reply, PutGroupsReply) and reply.accepted == 1
            await clients["synchronizer-0"].request(WeightVersion(version=1))
            assert role.queue.version == 1
            stats = await clients["monitor"].request(StatsRequest())
            assert stats.values["depth_groups"] == 1
            assert server.stats.forbidden == 8 and server.stats.requests == 11
        finally:
            for c in clients.values():
                c.close()
            serving.cancel()
            server.close()
            for t in transports.values():
                t.close()
            role.close()

    asyncio.run(main())


def test_only_the_launchers_key_stops_a_run_and_no_role_speaks_for_another(tmp_path):
    """The launcher's control socket: StopRun (item 3: `rollmesh stop` worked with fresh wrong
    keys, and model code sent one) is taken from the launcher's own key only; a role may say
    Hello, Ready, Fatal and heartbeats for itself only (a forged Fatal showed a healthy queue
    as fatal)."""
    from rollmesh.launcher.supervisor import Supervisor
    from rollmesh.wire.messages import Fatal, Heartbeat, Hello, Ok, StopRun
    from rollmesh.wire.transport import RemoteError, RpcClient

    keys = tmp_path / "keys"
    CurveKeys.generate(keys, ROLE_KEYS)
    stops: list[str] = []

    async def on_stop(msg: StopRun, peer: bytes) -> Ok:
        stops.append(msg.reason)
        return Ok(message="stopping")

    async def main():
        transports = {n: as_(keys, n) for n in ROLE_KEYS}
        sup = Supervisor(transports["launcher"], keys_dir=str(keys))
        sup.server.handlers[StopRun] = on_stop
        clients = {n: RpcClient(t, sup.control, timeout_s=5, retries=0)
                   for n, t in transports.items()}
        from types import SimpleNamespace  # the parts of a Child the handlers touch
        queue = sup.children["message_queue/0"] = SimpleNamespace(
            name="message_queue/0", state="ready", fatal=None, ready_event=asyncio.Event())
        try:
            for who, msg in (("reward_worker-0", StopRun(reason="sent by model code")),
                             ("monitor", StopRun(reason="the monitor is read-only")),
                             ("trainer-0", StopRun(reason="not the launcher")),
                             ("reward_worker-0", Fatal(role="message_queue", host="h", pid=1,
                                                       error="forged")),
                             ("reward_worker-0", Hello(role="trainer", host="h", pid=1)),
                             ("agent_worker-0", Heartbeat(sender="message_queue/0", seq=1))):
                with pytest.raises(RemoteError, match="forbidden") as e:
                    await clients[who].request(msg)
                assert who in str(e.value)
            assert stops == [] and sup.server.stats.forbidden == 6 and queue.state == "ready"
            assert "message_queue/0" not in sup.liveness.last_seen  # not kept "alive" by another
            reply = await clients["launcher"].request(StopRun(reason="rollmesh stop"))
            assert reply.message == "stopping" and stops == ["rollmesh stop"]
            await clients["message_queue-0"].request(
                Fatal(role="message_queue", host="h", pid=1, error="its own"))
            assert queue.state == "fatal" and queue.fatal.error == "its own"
        finally:
            del sup.children["message_queue/0"]
            for c in clients.values():
                c.close()
            await sup.close(grace_s=1)
            for t in transports.values():
                t.close()

    asyncio.run(main())


def test_the_rollouters_channel_takes_workers_only_and_keys_made_later(tmp_path):
    """The rollouter's work channel admits agent and reward workers only (a fake reward worker
    scored 1,553 trajectories, item 3): a message from the trainer's key is counted and
    dropped. A role process started after the socket (a restart, a test's role) gets a key
    that the run's sockets read when it first connects."""
    from rollmesh.wire.channels import Channel, ChannelClient
    from rollmesh.wire.messages import WorkerHello

    keys = tmp_path / "keys"
    CurveKeys.generate(keys, ROLE_KEYS)

    async def main():
        server_t = as_(keys, "rollouter-0")
        channel = Channel(server_t, "tcp://127.0.0.1:0", allow={"agent_worker", "reward_worker"})
        CurveKeys.add_identities(keys, ["reward_worker-7"])  # after the channel was bound
        senders = {n: as_(keys, n) for n in ("trainer-0", "reward_worker-7")}
        clients = {n: ChannelClient(t, channel.address) for n, t in senders.items()}
        try:
            await clients["trainer-0"].send(WorkerHello(worker="fake", kind="reward",
                                                        credits=10**6))
            await asyncio.sleep(0.5)  # the trainer's message first
            await clients["reward_worker-7"].send(WorkerHello(worker="w7", kind="reward",
                                                              credits=2))
            peer, msg = await asyncio.wait_for(channel.recv(), 10)
            assert msg.worker == "w7"
            # the trainer's message is dropped whenever it arrives (its handshake may finish
            # after the worker's): nothing else comes through, and it is counted
            deadline = time.monotonic() + 10
            while channel.forbidden < 1 and time.monotonic() < deadline:
                try:
                    extra = await asyncio.wait_for(channel.recv(), 0.5)
                except asyncio.TimeoutError:
                    continue
                raise AssertionError(f"through the channel: {extra}")
            assert channel.forbidden == 1
        finally:
            for c in clients.values():
                c.close()
            channel.close()
            for t in (server_t, *senders.values()):
                t.close()

    asyncio.run(main())
