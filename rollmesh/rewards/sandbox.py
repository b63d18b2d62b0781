"""Running reward functions in child processes, under a time limit.

`RewardSandbox` keeps a small pool of children, each `python -m rollmesh.rewards serve`, and
talks to them over their stdin/stdout pipes: frames of a 4-byte big-endian length and a msgpack
body (no pickle: the child runs only the functions it is named). A function that raises, returns
a non-number, hangs, or kills its process (os._exit, a segfault, the OOM killer) becomes an
explicit `RewardResult` ("error" or "timeout", reward None); a child that timed out or died is
killed and replaced by a fresh one for the next call. The caller never goes down with it.

Protocol, one request at a time per child:
  child -> parent at start: {"op": "ready", "pid"}
  parent -> child: {"op": "load", "fn"}  -> {"ok": true, "trajectory"} | {"ok": false, "error"}
                   (imports the function and runs its optional `warmup()` attribute, outside
                   the time limit; "trajectory": whether the function takes the trajectory view)
  parent -> child: {"op": "call", "fn", "response", "label", "metadata"[, "trajectory"]}
                   -> {"ok": true, "reward", "info"} | {"ok": false, "error", "info"}
                   ("trajectory", the view, only for a function that takes it: the parent
                   builds it only then)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

import msgpack

from rollmesh.runtime.isolation import die_with_parent, limit_data
from rollmesh.runtime.memcg import remove_named
from rollmesh.runtime.log import get_logger
from rollmesh.rewards.registry import check_reward_output, get_reward_fn, wants_trajectory

__all__ = ["RewardResult", "RewardSandbox", "serve"]

log = get_logger("rollmesh.rewards")

MAX_FRAME_BYTES = 64 << 20
# rollmesh's own rewards that need the network (a reward model over HTTP): a contained child
# has none, so they run in the worker (they run no code from data)
_NEEDS_NETWORK = {"remote"}
# What a contained child keeps of the worker's environment (plus RewardSandbox's `env`)
_KEPT_ENV = {"PATH", "LANG", "PYTHONPATH", "PYTHONHASHSEED", "TZ", "OMP_NUM_THREADS",
             "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM"}
_LEN = struct.Struct(">I")


@dataclass
class RewardResult:
    """The outcome of scoring one response. `reward` is None unless status is "ok": a failure is
    never a silent 0. `error` says what went wrong; `info` holds the function's extra fields (or
    the traceback of an error); `elapsed_s` is how long the function ran."""

    status: Literal["ok", "error", "timeout"]
    reward: float | None = None
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Died(Exception):
    """The child process ended; the message says how."""


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "reward process died (exit code unknown)"
    if code < 0:
        try:
            return f"reward process died with exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"reward process died with exit code {code}"


class _Child:
    """One `rollmesh.rewards serve` process and the functions it has loaded (each name: whether
    the function takes the trajectory view)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.loaded: dict[str, bool] = {}

    async def send(self, msg: dict[str, Any]) -> None:
        body = msgpack.packb(msg)
        if len(body) > MAX_FRAME_BYTES:
            raise ValueError(f"request of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_LEN.pack(len(body)) + body)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise _Died(await self._death()) from None

    async def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        try:
            (n,) = _LEN.unpack(await self.proc.stdout.readexactly(_LEN.size))
            if n > MAX_FRAME_BYTES:
                raise _Died(f"reward process sent a frame of {n} bytes (limit {MAX_FRAME_BYTES})")
            reply = msgpack.unpackb(await self.proc.stdout.readexactly(n))
        except asyncio.IncompleteReadError:
            raise _Died(await self._death()) from None
        if not isinstance(reply, dict):
            raise _Died(f"reward process sent a malformed reply: {reply!r:.200}")
        return reply

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        await self.send(msg)
        return await self.receive()

    async def _death(self) -> str:
        try:
            code = await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            await self.kill()
            code = None
        return _exit_reason(code)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        await self.proc.wait()
        # killed, it could not remove its memory cgroup (its contained child ends with it)
        await asyncio.to_thread(remove_named, f"rollmesh-reward-{self.proc.pid}")


def _result(reply: dict[str, Any], elapsed: float) -> RewardResult:
    """A child's (or `_handle`'s) answer to a call, as a RewardResult."""
    info = reply.get("info") if isinstance(reply.get("info"), dict) else {}
    if not reply.get("ok"):
        return RewardResult("error", error=str(reply.get("error")), info=info, elapsed_s=elapsed)
    return RewardResult("ok", float(reply["reward"]), info=info, elapsed_s=elapsed)


class RewardSandbox:
    """Scores responses with reward functions run in `size` child processes (concurrent calls
    beyond that wait for a free child). Use `async with RewardSandbox() as sb:` or `close()`.

    `memory_limit_mb` caps each child's data (RLIMIT_DATA: heap and private anonymous
    mappings, so shared libraries' and thread stacks' reservations do not count; the reward
    worker passes `rollout.reward_memory_mb`): a huge allocation then fails with an error
    naming the limit instead of meeting the OOM killer, and a child that dies of it is
    replaced; `env` is added to the
    children's environment; `stderr` is where their output goes (default: this process's
    stderr; a function's prints land there too, never on the protocol pipe). Functions named
    `"module:function"` must be importable in the child: its sys.path starts with the current
    working directory, then $PYTHONPATH.
    """

    def __init__(
        self,
        size: int = 2,
        *,
        memory_limit_mb: int | None = None,
        env: dict[str, str] | None = None,
        stderr: int | BinaryIO | None = None,
        start_timeout_s: float = 60.0,
        python: str = sys.executable,
        contained: bool = True,
        hide: list[str] | tuple[str, ...] = (),
    ) -> None:
        if size < 1:
            raise ValueError(f"RewardSandbox: size: expected int >= 1, got {size}")
        self.size, self.memory_limit_mb = size, memory_limit_mb
        self.env, self.stderr = env, stderr
        self.start_timeout_s, self.python = start_timeout_s, python
        self.contained, self.hide = contained, list(hide)
        self.isolation = "not contained (rollout.reward_allow_unsafe)"
        self._here: dict[str, Any] = {}  # _NEEDS_NETWORK's functions, loaded in this process
        self._free: asyncio.Queue[_Child | None] = asyncio.Queue()
        for _ in range(size):
            self._free.put_nowait(None)  # a slot whose child starts on first use
        self._children: set[_Child] = set()
        self._closed = False

    async def __aenter__(self) -> RewardSandbox:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """Start every child now rather than on first use."""
        slots = [self._free.get_nowait() for _ in range(self._free.qsize())]
        try:
            for i, slot in enumerate(slots):
                if slot is None:
                    slots[i] = await self._spawn()
        finally:
            for slot in slots:
                self._free.put_nowait(slot)

    async def _spawn(self) -> _Child:
        args = [self.python, "-m", "rollmesh.rewards", "serve", "--parent-pid", str(os.getpid())]
        if self.memory_limit_mb:
            args += ["--memory-limit-mb", str(self.memory_limit_mb)]
        env = {**os.environ, **(self.env or {})}
        if self.contained:  # the worker's environment (tokens a user put there) is not theirs
            args += ["--contain", *(f"--hide={p}" for p in self.hide)]
            env = {k: v for k, v in env.items() if k in _KEPT_ENV or k.startswith("LC_")}
            env.update(self.env or {})
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the role, which then closes us
        )
        child = _Child(proc)
        self._children.add(child)
        try:
            hello = await asyncio.wait_for(child.receive(), self.start_timeout_s)
            if hello.get("op") == "refused":
                raise _Died(str(hello.get("error")))
            if hello.get("op") != "ready":
                raise _Died(f"reward process said {hello!r:.200} instead of ready")
            self.isolation = str(hello.get("isolation") or self.isolation)
        except BaseException as e:
            await self._discard(child)
            if isinstance(e, TimeoutError):
                raise RuntimeError(
                    f"reward process not ready after {self.start_timeout_s}s"
                ) from None
            if isinstance(e, _Died):
                raise RuntimeError(f"reward process failed to start: {e}") from None
            raise
        log.debug("reward_process_started", pid=proc.pid)
        return child

    async def _discard(self, child: _Child) -> None:
        self._children.discard(child)
        await child.kill()

    async def score(
        self, name: str, response: str, label: Any, metadata: dict[str, Any], timeout_s: float,
        *, trajectory: Callable[[], dict[str, Any]] | None = None,
    ) -> RewardResult:
        """Score `response` with reward function `name` (entry-point name or "module:function"),
        killing it after `timeout_s` seconds of running (waiting for a free child and starting
        one are not counted). `trajectory` builds the trajectory view (in this process), called
        only if the function takes one (a `trajectory` parameter); such a function scored
        without it is an error."""
        if self._closed:
            raise RuntimeError("RewardSandbox is closed")
        if self.contained and name in _NEEDS_NETWORK:
            return await self._score_here(name, response, label, metadata, timeout_s)
        child = await self._free.get()
        try:
            if self._closed:  # closed while this call waited for a free child
                raise RuntimeError("RewardSandbox is closed")
            if child is None or child.proc.returncode is not None:
                if child is not None:
                    await self._discard(child)
                child = None
                try:
                    child = await self._spawn()
                except RuntimeError as e:
                    return RewardResult("error", error=str(e))
            result = await self._score(child, name, response, label, metadata, timeout_s,
                                       trajectory)
            if result.status != "ok" and child.proc.returncode is not None:
                await self._discard(child)
                child = None
            return result
        except BaseException:  # cancelled mid-request: the child's state is unknown
            if child is not None:
                await self._discard(child)
            child = None
            raise
        finally:
            self._free.put_nowait(child)

    async def _score_here(self, name: str, response: str, label: Any, metadata: dict[str, Any],
                          timeout_s: float) -> RewardResult:
        """rollmesh's own reward that asks a reward model over HTTP (`_NEEDS_NETWORK`): in this
        process, on a thread (it runs no code from data, and a contained child has no
        network)."""
        msg = {"op": "call", "fn": name, "response": response, "label": label,
               "metadata": metadata}
        start = time.monotonic()
        try:
            reply = await asyncio.wait_for(asyncio.to_thread(_handle, msg, self._here), timeout_s)
        except TimeoutError:
            return RewardResult("timeout", error=f"timed out after {timeout_s:g}s",
                                elapsed_s=time.monotonic() - start)
        return _result(reply, time.monotonic() - start)

    async def _score(
        self, child: _Child, name: str, response: str, label: Any, metadata: dict[str, Any],
        timeout_s: float, trajectory: Callable[[], dict[str, Any]] | None,
    ) -> RewardResult:
        try:
            if name not in child.loaded:  # importing is not the function's time
                reply = await asyncio.wait_for(
                    child.request({"op": "load", "fn": name}), self.start_timeout_s
                )
                if not reply.get("ok"):
                    return RewardResult("error", error=str(reply.get("error")))
                child.loaded[name] = bool(reply.get("trajectory"))
        except TimeoutError:
            await child.kill()
            why = f"loading {name!r} took over {self.start_timeout_s}s"
            return RewardResult("error", error=why)
        except _Died as e:
            return RewardResult("error", error=str(e))

        request = {"op": "call", "fn": name, "response": response, "label": label,
                   "metadata": metadata}
        if child.loaded[name] and trajectory is not None:
            request["trajectory"] = trajectory()
        try:
            msgpack.packb(request)
        except (TypeError, ValueError, OverflowError) as e:
            return RewardResult("error", error=f"request is not plain data: {e}")
        start = time.monotonic()
        try:
            reply = await asyncio.wait_for(child.request(request), timeout_s)
        except TimeoutError:
            await child.kill()
            return RewardResult(
                "timeout", error=f"timed out after {timeout_s:g}s",
                elapsed_s=time.monotonic() - start,
            )
        except _Died as e:
            why = str(e)
            if self.memory_limit_mb:  # a C extension whose malloc failed may abort or crash
                why += f" (its memory limit is {self.memory_limit_mb} MiB, rollout.reward_memory_mb)"
            return RewardResult("error", error=why, elapsed_s=time.monotonic() - start)
        return _result(reply, time.monotonic() - start)

    async def close(self) -> None:
        """Kill every child (idempotent)."""
        self._closed = True
        children, self._children = list(self._children), set()
        await asyncio.gather(*(c.kill() for c in children))


# ---------------------------------------------------------------------------------------------
# The child: `python -m rollmesh.rewards serve`
# ---------------------------------------------------------------------------------------------


def _call(fn: Any, name: Any, msg: dict[str, Any]) -> Any:
    """`fn` on the request's arguments, and its trajectory view if it takes one."""
    args = (msg.get("response"), msg.get("label"), msg.get("metadata") or {})
    if not wants_trajectory(fn):
        return fn(*args)
    if "trajectory" not in msg:
        raise ValueError(f"reward function {name!r} takes a trajectory (its `trajectory` "
                         "parameter), and this request carries none")
    return fn(*args, trajectory=msg["trajectory"])


def _handle(msg: Any, fns: dict[str, Any], memory_limit_mb: int | None = None) -> dict[str, Any]:
    if not isinstance(msg, dict) or msg.get("op") not in ("load", "call"):
        return {"ok": False, "error": f"malformed request: {msg!r:.200}"}
    name = msg.get("fn")
    try:
        if name not in fns:
            fns[name] = get_reward_fn(str(name))
        if msg["op"] == "load":
            warmup = getattr(fns[name], "warmup", None)
            if callable(warmup):
                warmup()
            return {"ok": True, "trajectory": wants_trajectory(fns[name])}
        reward, info = check_reward_output(_call(fns[name], name, msg), name)
        return {"ok": True, "reward": reward, "info": info}
    except MemoryError as e:
        where = f" (memory limit {memory_limit_mb} MiB, rollout.reward_memory_mb)" \
            if memory_limit_mb else ""
        return {"ok": False, "error": f"MemoryError{': ' + str(e) if str(e) else ''}{where}",
                "info": {"traceback": traceback.format_exc(limit=-8)}}
    except BaseException as e:  # SystemExit and KeyboardInterrupt from a reward are failures too
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
            "info": {"traceback": traceback.format_exc(limit=-8)},
        }


# A reward process's memory cgroup holds reward_memory_mb and this much more (the interpreter,
# rollmesh's modules and the page cache they were read through).
CGROUP_HEADROOM_MB = 128


def _contain(memory_mb: int, hide: list[str] | tuple[str, ...], limit: bool = True) -> str:
    """This process as a boundary for reward code from data (`private_root.confine`): new
    network, IPC, PID and mount namespaces, a root of its own that shows the system, the
    interpreter and the import path (sys.path, rollmesh) read-only and covers `hide` (the run's
    directory), a fresh working directory, as root a uid of its own; no capability. With
    `limit`, a memory cgroup counts all its pages, shared ones too (`memcg.py`), where one
    can be made."""
    import tempfile

    import rollmesh
    from rollmesh.runtime import private_root
    from rollmesh.runtime.memcg import MemoryGroup
    from rollmesh.runtime.isolation import SANDBOX_UIDS

    sys.path[:] = [os.path.abspath(p or os.curdir) for p in sys.path]  # '' was the cwd
    extra = [p for p in sys.path if os.path.isdir(p)]
    extra.append(os.path.dirname(os.path.abspath(rollmesh.__file__)))
    work = tempfile.mkdtemp(prefix="rollmesh-reward-")
    uid = None
    if os.geteuid() == 0:
        uid = SANDBOX_UIDS[(os.getpid() * 7919 + 1) % len(SANDBOX_UIDS)]
        os.chown(work, uid, uid)
    group, memory = None, "no memory limit asked"
    if limit:
        group, memory = MemoryGroup.make(f"rollmesh-reward-{os.getpid()}",
                                         (memory_mb + CGROUP_HEADROOM_MB) << 20)
        if group is None:
            memory = f"data limit only ({memory})"
    try:
        how = private_root.confine(work, memory_mb, extra, uid, hide, group) + f", {memory}"
    except OSError:
        os.rmdir(work)
        if group is not None:
            group.remove()
        raise
    os.chdir(work)
    os.environ["HOME"] = os.environ["TMPDIR"] = work
    tempfile.tempdir = None
    return how


def serve(parent_pid: int = 0, memory_limit_mb: int | None = None, contain: bool = False,
          hide: list[str] | tuple[str, ...] = ()) -> int:
    """The child's loop: read requests from stdin, answer on stdout, until stdin closes.
    `contain`: first `_contain` this process (a refusal is answered, op "refused")."""
    # The pipes belong to the protocol: a function's print() or a C library's write to fd 1
    # would corrupt it, and a read from fd 0 would eat requests. Keep private copies and point
    # fds 0 and 1 elsewhere.
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    die_with_parent(parent_pid)

    def reply(msg: dict[str, Any]) -> None:
        try:
            body = msgpack.packb(msg)
        except (TypeError, ValueError, OverflowError) as e:
            body = msgpack.packb({"ok": False, "error": f"reply is not plain data: {e}"})
        if len(body) > MAX_FRAME_BYTES:
            body = msgpack.packb(
                {"ok": False, "error": f"reply of {len(body)} bytes exceeds {MAX_FRAME_BYTES}"}
            )
        replies.write(_LEN.pack(len(body)) + body)
        replies.flush()

    isolation = "not contained"
    if contain:
        try:
            isolation = _contain(memory_limit_mb or 512, hide, limit=bool(memory_limit_mb))
        except OSError as e:
            reply({"op": "refused", "error": f"reward sandbox: {e}; reward functions are not "
                   "run without it (rollout.reward_allow_unsafe = true runs them so)"})
            return 3
    if memory_limit_mb:
        limit_data(memory_limit_mb)  # RLIMIT_DATA, not RLIMIT_AS: its docstring says why

    reply({"op": "ready", "pid": os.getpid(), "isolation": isolation})
    fns: dict[str, Any] = {}
    while True:
        header = requests.read(_LEN.size)
        if len(header) < _LEN.size:
            return 0  # the parent closed the pipe
        (n,) = _LEN.unpack(header)
        if n > MAX_FRAME_BYTES:
            return 2
        body = requests.read(n)
        if len(body) < n:
            return 0
        try:
            msg = msgpack.unpackb(body)
        except Exception as e:  # msgpack raises several types for bad bytes
            reply({"ok": False, "error": f"undecodable request: {e}"})
            continue
        reply(_handle(msg, fns, memory_limit_mb))
