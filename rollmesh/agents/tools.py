"""Tools for multi-turn agent loops: `calculator`, always there
(`rollmesh.agents.loops.builtin_tools`), and `python`, registered under the entry-point group
`rollmesh.tools` like a user's own tools.

`calculator(expression)` evaluates arithmetic (+ - * / // % ** and parentheses) by walking the
expression's syntax tree, never with eval; a bad expression raises, and the loop tells the model.

`python(code)` runs the model's code in a separate, limited process and returns what it printed
(stdout and stderr together), a traceback when it raised, and one line per limit it hit
("error: CPU time limit (10 s) exceeded"): every outcome is a message for the model, the worker
never goes down with the code. The child is `rollmesh/runtime/isolation.py` run as a script (its
docstring has the mechanics): network, PID, IPC and mount namespaces (without them the code is
not run, unless `rollout.python_tool.allow_unsafe`), a root of its own that shows the system's
and the interpreter's files read-only and nothing of the run's directory, rlimits on CPU time, memory, file size and processes, a fresh
temporary directory as cwd (removed afterwards) and a clean environment, `-I -S` isolation from
the worker's environment, a uid of its own with no capability when the worker runs as root, and
a supervisor that kills whatever the code left running. The limits are `rollout.python_tool.*`; `LoopContext`
hands the rollout's to every tool with a `configured(rollout)` method.

What is not a boundary: the audit hook that refuses writes outside the directory and socket
calls is a tripwire that code using ctypes or another program passes; writes outside the
directory are refused by the read-only private root (and, as root, by file permissions); the
limits are per process (memory at most max_processes times memory_mb in all, /tmp and /dev/shm
one memory_mb each), and where a memory cgroup can be made (`rollmesh/runtime/memcg.py`: as
root, or in a delegated group) every page of the call together, shared mappings and its tmpfs
files included, is held to memory_mb + 64 MiB; elsewhere an anonymous shared mapping counts
against the address-space limit (4x memory_mb) only.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import operator
import os
import shutil
import signal
import stat
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rollmesh.config import PythonToolConfig, RolloutConfig
from rollmesh.runtime import isolation
from rollmesh.runtime.isolation import SANDBOX_UIDS
from rollmesh.runtime.memcg import remove_named
from rollmesh.runtime.log import get_logger

__all__ = ["PythonRun", "PythonTool", "calculator", "python"]

log = get_logger("rollmesh.agents.tools")

_SUPERVISOR = str(Path(isolation.__file__))  # run as a script, not imported there
_STARTUP_GRACE_S = 10.0  # the supervisor's start and clean-up, beyond the code's wall limit
_MAX_CODE_BYTES = 1 << 20
_logged_isolation: set[str] = set()
_uid_turn = 0


@dataclass
class PythonRun:
    """What one run of the `python` tool came to. `limits` names each limit hit: "cpu",
    "wall", "memory", "file_size", "processes", "output"."""

    output: str = ""
    output_bytes: int = 0
    exit_code: int | None = None
    signal: str | None = None
    limits: list[str] = field(default_factory=list)
    isolation: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # the sandbox itself failed (the code did not run, or not to the end)
    cpu_s: float = 0.0
    wall_s: float = 0.0


class PythonTool:
    """The `python` tool: `await tool(code)` is the model's result text, `await tool.run(code)`
    the structured `PythonRun`. `timeout_s` is the caller's limit on one call
    (rollout.tool_timeout_s): the code's wall limit stays a second under it, so that the tool
    can report it. `tmp_root` is where the per-call directories go (default: the system's temp
    directory); `namespaces=False` skips the namespaces (to test the fallback)."""

    def __init__(self, config: PythonToolConfig | None = None, *, timeout_s: float | None = None,
                 tmp_root: str | os.PathLike[str] | None = None, namespaces: bool = True,
                 python: str = sys.executable) -> None:
        self.config = config if config is not None else PythonToolConfig()
        self.timeout_s = timeout_s if timeout_s is not None else RolloutConfig().tool_timeout_s
        self.tmp_root = None if tmp_root is None else str(tmp_root)
        self.namespaces, self.python = namespaces, python

    def configured(self, rollout: RolloutConfig) -> PythonTool:
        """This tool under the rollout's limits (LoopContext calls it)."""
        return PythonTool(rollout.python_tool, timeout_s=rollout.tool_timeout_s,
                          tmp_root=self.tmp_root, namespaces=self.namespaces, python=self.python)

    async def check(self) -> dict[str, str]:
        """Run nothing through the sandbox once: its isolation, or RuntimeError naming what the
        kernel refused (an agent worker calls it before it is ready, so that a host where
        model code cannot be isolated fails the launch, not the first tool call)."""
        run = await self.run("pass")
        if run.error:
            raise RuntimeError(run.error)
        return run.isolation

    @property
    def wall_s(self) -> float:
        return min(self.config.wall_s, max(self.timeout_s - 1.0, self.timeout_s / 2))

    async def __call__(self, code: str) -> str:
        """Run `code` (a Python program) and return its output and every limit it hit."""
        return self.message(await self.run(code))

    def message(self, run: PythonRun) -> str:
        """The model's view of a run: the output, then one line per problem."""
        c = self.config
        lines = [run.output.rstrip("\n")] if run.output.strip() else []
        words = {
            "cpu": f"error: CPU time limit ({c.cpu_s} s) exceeded",
            "wall": f"error: time limit ({self.wall_s:g} s) exceeded; the code was stopped",
            "memory": f"error: memory limit ({c.memory_mb} MiB) exceeded",
            "file_size": f"error: file size limit ({c.file_mb} MiB per file) exceeded",
            "processes": f"error: process limit ({c.max_processes} processes) reached",
        }
        lines += [words[k] for k in run.limits if k in words]
        if run.error:
            lines.append(f"error: {run.error}")
        elif not any(k in words for k in run.limits):
            if run.signal:
                lines.append(f"error: the code was killed by {run.signal}")
            elif run.exit_code not in (0, None) and not (run.exit_code == 1 and lines):
                lines.append(f"exit status {run.exit_code}")
        return "\n".join(lines) if lines else "(no output)"

    async def run(self, code: str) -> PythonRun:
        """Run `code` in a fresh limited child (module docstring); never raises for what the
        code does."""
        if not isinstance(code, str):
            return PythonRun(error=f"python: code must be a string, got {type(code).__name__}")
        if len(code.encode(errors="replace")) > _MAX_CODE_BYTES:
            return PythonRun(error=f"python: code longer than {_MAX_CODE_BYTES} bytes")
        if not sys.platform.startswith("linux"):
            return PythonRun(error="the python tool runs code on Linux only")
        c = self.config
        workdir = tempfile.mkdtemp(prefix="rollmesh-python-", dir=self.tmp_root)
        status_r, status_w = os.pipe()
        proc: asyncio.subprocess.Process | None = None
        reader: asyncio.Task[tuple[bytes, int]] | None = None
        try:
            uid = _next_uid()
            if os.geteuid() == 0:  # the code runs as `uid`: its directory is its own
                os.chown(workdir, uid, uid)
            spec = {"code": code, "uid": uid, "dir": workdir, "cpu_s": c.cpu_s,
                    "wall_s": self.wall_s,
                    "memory_mb": c.memory_mb, "file_mb": c.file_mb,
                    "max_processes": c.max_processes, "namespaces": self.namespaces,
                    "require_isolation": not c.allow_unsafe,
                    "site_dirs": _site_dirs() if c.site_packages else []}
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                   "HOME": workdir, "TMPDIR": workdir, "USER": "sandbox",
                   "LOGNAME": "sandbox",
                   # one thread per numerical library, not one per core: threads count as
                   # processes against max_processes
                   **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                       "MKL_NUM_THREADS")}}
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", "-B", "-u", _SUPERVISOR, str(status_w),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env, cwd=workdir,
                start_new_session=True, pass_fds=(status_w,))
            os.close(status_w)
            status_w = -1
            assert proc.stdin is not None and proc.stdout is not None
            reader = asyncio.create_task(_read_output(proc.stdout, c.max_output))
            proc.stdin.write(json.dumps(spec).encode())
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.drain()
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), self.wall_s + _STARTUP_GRACE_S)
            except TimeoutError:
                await _stop(proc)
                return PythonRun(error="the python tool's supervisor did not finish in time; "
                                       "its processes were killed")
            try:  # the supervisor killed every process of the code: the pipe is at its end
                raw, total = await asyncio.wait_for(asyncio.shield(reader), 5.0)
            except TimeoutError:
                raw, total = b"", 0
            status = _read_status(status_r)
            return self._result(raw, total, status, proc.returncode)
        except BaseException:
            if proc is not None and proc.returncode is None:
                await _stop(proc)
            raise
        finally:
            if reader is not None and not reader.done():
                reader.cancel()
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            await asyncio.to_thread(_remove_tree, workdir)

    def _result(self, raw: bytes, total: int, status: dict[str, Any] | None,
                returncode: int | None) -> PythonRun:
        output = raw.decode(errors="replace")
        run = PythonRun(output=output, output_bytes=total)
        if total > len(raw):
            run.limits.append("output")
        if status is None:
            run.error = f"the python tool's supervisor ended without a report (exit {returncode})"
            return run
        run.isolation = status.get("isolation") or {}
        self._log_isolation(run.isolation)
        run.exit_code, run.signal = status.get("exit_code"), status.get("signal")
        run.cpu_s, run.wall_s = status.get("cpu_s", 0.0), status.get("wall_s", 0.0)
        run.limits = [*status.get("limits", []), *run.limits]
        if status.get("setup_error"):
            run.error = f"the python tool could not start the code: {status['setup_error']}"
        return run

    @staticmethod
    def _log_isolation(isolation: dict[str, str]) -> None:
        key = json.dumps(isolation, sort_keys=True)
        if isolation and key not in _logged_isolation:
            _logged_isolation.add(key)
            weak = isolation.get("network") != "network namespace"
            (log.warning if weak else log.info)("python_tool_isolation", **isolation)


async def _read_output(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Everything the code prints, to the end, keeping its first and last `limit`/2 bytes:
    (those with a note between them where bytes were left out, total bytes printed)."""
    head_cap = limit // 2
    tail_cap = limit - head_cap
    head, tail, total = bytearray(), bytearray(), 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        if len(head) < head_cap:
            take = head_cap - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        tail += chunk
        if len(tail) > tail_cap:
            del tail[:len(tail) - tail_cap]
    if total <= limit:
        return bytes(head + tail), total
    omitted = total - len(head) - len(tail)
    note = (f"\n[... {omitted} bytes of output left out: the output limit is {limit} bytes "
            "...]\n").encode()
    return bytes(head) + note + bytes(tail), total


def _read_status(fd: int) -> dict[str, Any] | None:
    """The supervisor's JSON report (written before it exited), None if there is none."""
    os.set_blocking(fd, False)
    data = bytearray()
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    try:
        status = json.loads(data)
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ask the supervisor to kill the code and report (SIGTERM); after 3 s kill its session."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 3.0)
    except (TimeoutError, asyncio.CancelledError):
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the code's child has PR_SET_PDEATHSIG too
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(proc.wait())
    # a supervisor killed before its clean-up leaves the call's memory cgroup (isolation.py)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(asyncio.to_thread(remove_named, f"rollmesh-call-{proc.pid}"))


def _next_uid() -> int:
    """The uid of the next call's code when the worker is root (isolation.SANDBOX_UIDS): the
    next in turn, from a start that differs between worker processes. Two calls sharing one
    (after 65536 calls at once, or between workers by chance) only share its process limit."""
    global _uid_turn
    _uid_turn += 1
    return SANDBOX_UIDS[(os.getpid() * 7919 + _uid_turn) % len(SANDBOX_UIDS)]


def _site_dirs() -> list[str]:
    """The worker's site-packages directories (python_tool.site_packages)."""
    paths = sysconfig.get_paths()
    return sorted({p for p in (paths.get("purelib"), paths.get("platlib")) if p})


def _remove_tree(path: str) -> None:
    def writable(func: Any, p: str, _exc: Any) -> None:  # the code may have taken its own rights
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
            func(p)

    shutil.rmtree(path, onerror=writable)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


python = PythonTool()


# ---- calculator ----------------------------------------------------------------------------
_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


CALCULATOR_MAX_BITS = 4096  # an integer result's size (about 1,233 digits)


def _result_bits(op: ast.operator, a: Any, b: Any) -> int:
    """An upper bound on the bits of integer `a op b`, known before computing it: big-integer
    arithmetic holds the interpreter lock, so a time limit cannot stop `(9**99)**99...`."""
    if not (isinstance(a, int) and isinstance(b, int)):
        return 0  # floats overflow to an error quickly
    bits_a, bits_b = max(abs(a).bit_length(), 1), max(abs(b).bit_length(), 1)
    if isinstance(op, ast.Pow):
        return 0 if b < 0 or abs(a) <= 1 else bits_a * b
    if isinstance(op, ast.Mult):
        return bits_a + bits_b
    return max(bits_a, bits_b) + 1


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % ** and parentheses) without eval. An integer result
    past CALCULATOR_MAX_BITS is refused before it is computed."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            if _result_bits(node.op, left, right) > CALCULATOR_MAX_BITS:
                raise ValueError(f"result too large (over {CALCULATOR_MAX_BITS} bits)")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)
