"""Reward functions that misbehave, for tests/unit/test_rewards.py (loaded by "module:function")."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any


def constant(response: str, label: Any, metadata: dict) -> float:
    return float(metadata.get("value", 0.5))


def with_info(response: str, label: Any, metadata: dict) -> dict:
    return {"reward": 0.25, "length": len(response), "label_seen": label}


def chatty(response: str, label: Any, metadata: dict) -> float:
    # Writes to fd 1 from Python and from C: neither may reach the protocol pipe.
    print("noise on stdout " * 100)
    sys.stdout.flush()
    os.write(1, b"\x00\x00\x00\x05raw bytes on fd 1\n")
    return 1.0


def raising(response: str, label: Any, metadata: dict) -> float:
    raise ValueError(f"bad response {response!r}")


def hanging(response: str, label: Any, metadata: dict) -> float:
    while True:
        time.sleep(0.05)


def busy_loop(response: str, label: Any, metadata: dict) -> float:
    while True:
        pass


def exiting(response: str, label: Any, metadata: dict) -> float:
    os._exit(3)


def segfault(response: str, label: Any, metadata: dict) -> float:
    ctypes.string_at(0)
    return 1.0


def greedy(response: str, label: Any, metadata: dict) -> float:
    hog = bytearray(8 << 30)  # 8 GiB: over any memory limit the tests set
    return float(len(hog))


def unbounded(response: str, label: Any, metadata: dict) -> float:
    hogs = []
    while True:  # 64 MiB at a time, touched, until something stops it
        hogs.append(bytearray(b"x" * (64 << 20)))


def returns_string(response: str, label: Any, metadata: dict) -> Any:
    return "1.0"


def returns_nan(response: str, label: Any, metadata: dict) -> float:
    return float("nan")


def sleepy(response: str, label: Any, metadata: dict) -> float:
    time.sleep(metadata["sleep_s"])
    return 1.0


def pid(response: str, label: Any, metadata: dict) -> dict:
    return {"reward": 1.0, "pid": os.getpid()}


not_callable = 42


def reads_trajectory(response: str, label: Any, metadata: dict, trajectory: dict) -> dict:
    return {"reward": float(trajectory["num_turns"]),
            "roles": [t["role"] for t in trajectory["turns"]],
            "tools": [c["name"] for c in trajectory["tool_calls"]], "response": response}


def reads_trajectory_by_keyword(response: str, label: Any, metadata: dict, *,
                                trajectory: dict | None = None) -> float:
    return 1.0 if trajectory is not None and trajectory["agent_loop"] == "tool_agent" else 0.0


def trajectory_raising(response: str, label: Any, metadata: dict, trajectory: dict) -> float:
    raise ValueError(f"no answer in {trajectory['num_turns']} turns")


def takes_any_keyword(response: str, label: Any, metadata: dict, **kwargs: Any) -> float:
    return float(len(kwargs))  # 0.0: a `trajectory` parameter must be declared by name


def hostile(response: str, label: Any, metadata: dict) -> dict:
    """What a hostile reward function from a dataset tries (issue 35, item 10): read the run's
    key, list a hidden directory, reach a listener, read the worker's environment, signal the
    worker, fill /dev/shm past its memory limit. Through ctypes where Python would be seen."""
    import ctypes
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    found: dict[str, Any] = {"secret": libc.open(metadata["secret"].encode(), os.O_RDONLY) >= 0}
    hidden = metadata["hidden"]
    try:
        found["hidden"] = bool(os.listdir(hidden))
    except OSError:
        found["hidden"] = False
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect(("127.0.0.1", int(metadata["port"])))
        found["network"] = True
    except OSError:
        found["network"] = False
    finally:
        s.close()
    found["env"] = sorted(k for k in os.environ if k.startswith("ROLLMESH_TEST_SECRET"))
    try:
        os.kill(int(metadata["worker"]), 0)
        found["signal_worker"] = True
    except OSError:
        found["signal_worker"] = False
    fd = libc.open(b"/dev/shm/rollmesh-test-ballast", os.O_CREAT | os.O_WRONLY, 0o600)
    chunk, n = b"x" * (1 << 20), 0
    while fd >= 0 and n < 400 and libc.write(fd, chunk, len(chunk)) == len(chunk):
        n += 1
    found["shm_mb"] = n
    found["uid"] = os.getuid()
    return {"reward": 0.0, **{f"found_{k}": v for k, v in found.items()}}


def shared_ballast(response: str, label: Any, metadata: dict) -> dict:
    """Touches an anonymous shared mapping of `metadata["mb"]` MiB: not "data" (RLIMIT_DATA
    does not count it), so only a memory cgroup stops it (issue 35, item 7)."""
    import mmap

    size = int(metadata["mb"]) << 20
    m = mmap.mmap(-1, size)  # MAP_SHARED | MAP_ANONYMOUS
    for i in range(0, size, 4096):
        m[i] = 1
    return {"reward": 1.0, "touched_mb": int(metadata["mb"])}
