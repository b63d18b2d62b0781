"""Running untrusted code in a limited child process (Linux), with the standard library only.

Two users: the reward sandbox (`rollmesh.rewards.sandbox`) imports `die_with_parent` and
`limit_data`; the `python` tool (`rollmesh.agents.tools`) runs this file as a script,
`python -I -S -B -u rollmesh/runtime/isolation.py`, its spec (the code and the limits) a JSON object on
stdin and a status pipe as fd `status_fd`. The script does not import rollmesh: `-I -S` leaves
the worker's site-packages (and PYTHONPATH) out of the child.

The script (the "supervisor") and the child it forks (which runs the code):

- supervisor: enters new network, PID, IPC and mount namespaces where the OS allows (as root
  directly; otherwise inside a new user namespace), becomes a child subreaper, forks the child,
  enforces the wall-clock limit, then kills every process the code left behind (killing the PID
  namespace's first process ends all of them; without one, every process whose parent is the
  supervisor or that is in the code's session, repeatedly, orphans coming back to the
  supervisor as subreaper), and writes a JSON status (exit, CPU time, which limits were hit,
  which isolation applied) to the status pipe;
- child: dies with the supervisor (PR_SET_PDEATHSIG), starts its own session; in the mount
  namespace, pivots into a root of its own (`private_root.py`: the system's and the interpreter's
  directories read-only, its own directory, a /proc of its PID namespace, /tmp and /dev/shm
  as tmpfs of the memory limit's size; nothing of the run's directory, keys or other
  processes); when running as root, drops to a uid/gid of its own (SANDBOX_UIDS) with no
  capability, so that RLIMIT_NPROC (which root ignores) applies and file permissions hold;
  otherwise drops the capabilities its user namespace gave; sets no_new_privs, the rlimits
  (CPU, data, address space, file size, processes, no core files), cwd = the fresh directory,
  an audit hook (refuses writes outside the directory, connect/bind/sendto, signalling a
  process group or everything, and, when no network namespace could be made, creating any
  socket but AF_UNIX); then runs the code as `__main__` from the file name `<code>`.

Without the network, PID and mount namespaces the code is not run at all unless the user set
rollout.python_tool.allow_unsafe; then, as root, the code keeps CAP_DAC_READ_SEARCH (an
interpreter under a private home must stay importable) and can read any file.

RLIMIT_NPROC counts tasks (threads too) by real uid, system-wide; root is exempt. So: as root,
the code runs as a uid of its own per call and the limit is that uid's count now (none, unless
two calls share it) plus max_processes; otherwise, inside a new user namespace, which Linux >=
5.14 counts on its own, the limit is max_processes (plus the supervisor); failing that, the
worker uid's count now plus max_processes, which concurrent calls share loosely (one call's
processes count against another's).

The audit hook is a tripwire, not a security boundary: code using ctypes, or running another
program, is not seen by it. The boundaries are the namespaces, the rlimits, the unprivileged uid
and the supervisor's kill. Without a PID namespace and not as root, code that passes the hook
can signal (and, where ptrace is not restricted, trace) the worker's own processes: same uid.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
import time

__all__ = ["SANDBOX_UIDS", "count_tasks", "die_with_parent", "limit_data"]

if __package__:
    from rollmesh.runtime import memcg as _memcg, private_root as _pr
else:  # run as a script (-I -S: rollmesh is not importable there): the files beside this one
    import importlib.util

    def _beside(name: str):  # type: ignore[no-untyped-def]
        spec = importlib.util.spec_from_file_location(
            f"_rollmesh_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                              f"{name}.py"))
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module

    _pr, _memcg = _beside("private_root"), _beside("memcg")

# A call's memory cgroup holds its memory_mb and this much more: the interpreter's own pages
# (RLIMIT_DATA counts its heap against memory_mb already) and slack.
CGROUP_HEADROOM_MB = 64


# What the code runs as when the worker is root: a uid of its own per call (so that the process
# limit counts that call's processes only, and calls cannot signal each other), from a range
# above sssd's default ID mapping (to 2000200000) and below systemd's reserved ranges
# (0x7FFE0000 on) and 2**31; no user has these.
SANDBOX_UIDS = range(2_100_000_000, 2_100_000_000 + 65536)
CODE_FILENAME = "<code>"

# prctl(2)
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_READ = 23
CAP_DAC_READ_SEARCH = 2
# unshare(2)
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# Byte flags the child (and every process it forks) sets in a page shared with the supervisor.
# Then the child's identity (64 bytes at _USER_AT) and why its setup failed (at _ERROR_AT).
FLAG_MEMORY, FLAG_FILE_SIZE, FLAG_PROCESSES, FLAG_SETUP, FLAG_CPU = range(5)
_FLAG_NAMES = {FLAG_CPU: "cpu", FLAG_MEMORY: "memory", FLAG_FILE_SIZE: "file_size",
               FLAG_PROCESSES: "processes"}
_USER_AT, _ERROR_AT, _ERROR_LEN, _FILES_AT = 64, 128, 1024, 1280
EXIT_SETUP_FAILED = 125


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc: ctypes.CDLL, *args: int) -> int:
    res = libc.prctl(*(ctypes.c_ulong(a) for a in args), *([ctypes.c_ulong(0)] * (5 - len(args))))
    if res < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({args[0]}): {os.strerror(e)}")
    return res


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Linux: get `sig` when the parent exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        _prctl(_libc(), PR_SET_PDEATHSIG, sig)
    if parent_pid and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def limit_data(memory_mb: int) -> None:
    """Cap this process's data (RLIMIT_DATA: heap and private writable mappings, Linux >= 4.7)
    at `memory_mb` MiB. Not RLIMIT_AS, which also counts reservations that use no memory
    (thread stacks, malloc arenas, a library's PROT_NONE regions) and fails imports of big
    libraries far below the limit."""
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def count_tasks(uid: int) -> int:
    """Tasks (threads) whose real uid is `uid`, what RLIMIT_NPROC counts."""
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        real = threads = None
        for line in text.splitlines():
            if line.startswith(b"Uid:"):
                real = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
        if real == uid:
            n += threads or 1
    return n


# ---------------------------------------------------------------------------------------------
# The supervisor (this file run as a script)
# ---------------------------------------------------------------------------------------------


class _Stop(Exception):
    """SIGTERM from the worker: stop the code now."""


def _unshare(libc: ctypes.CDLL) -> tuple[bool, bool, bool]:
    """Enter new namespaces, the most that the OS allows: (network, pid, mount) where the mount
    namespace is only probed (a forked process tries it, before the PID namespace, whose first
    process it would otherwise be): the child makes its own, since a pivot_root there would
    move this process's root too. Without root, only inside a user namespace entered before."""
    probe = os.fork()
    if probe == 0:
        os._exit(0 if libc.unshare(ctypes.c_int(CLONE_NEWNS)) == 0 else 1)
    _, st = os.waitpid(probe, 0)
    mnt = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    for flags, net, pid in ((CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC, True, True),
                            (CLONE_NEWNET | CLONE_NEWIPC, True, False),
                            (CLONE_NEWNET, True, False)):
        if libc.unshare(ctypes.c_int(flags)) == 0:
            return net, pid, mnt
    return False, False, mnt


def _limit_processes_in_user_namespace(n: int) -> bool:
    """RLIMIT_NPROC = `n` counted within this (new, empty) user namespace: Linux >= 5.14 counts
    a namespace's tasks against its own limit (and the whole uid's against the limit in force
    where the namespace was made); older kernels count the whole uid, which a test fork shows."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (n, hard))
    try:
        pid = os.fork()
    except BlockingIOError:
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        return False
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    return True


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, session id) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])  # state ppid pgrp session


def _reap() -> bool:
    """Collect dead children; True while any child is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _kill_leftovers(session: int, timeout_s: float = 5.0) -> int:
    """SIGKILL every process the code left: this process's children (orphans come back to it,
    a subreaper) and the members of the code's `session`, until none is left. Returns how many
    were killed."""
    me, killed = os.getpid(), 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        victims = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != me:
                st = _stat(name)
                if st is not None and (st[0] == me or st[1] == session):
                    victims.append(int(name))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if not _reap() and not victims:
            return killed
        time.sleep(0.005)
    return killed


def _drop_root(libc: ctypes.CDLL, uid: int, private_root: bool) -> str:
    """From root to `uid` with no capabilities at all (the code read any file while it kept
    CAP_DAC_READ_SEARCH: the run's keys, /etc/shadow). The interpreter's files stay readable
    through the private root (`private_root.private_root`), which shows their directories at
    their paths whatever the modes of the directories above them. Without one (no mount namespace: only
    with rollout.python_tool.allow_unsafe), CAP_DAC_READ_SEARCH is kept so that an interpreter
    under a private home can still import: the code can then read any file. Returns a
    description for the status."""
    keep = None
    if not private_root and _prctl(libc, PR_CAPBSET_READ, CAP_DAC_READ_SEARCH) == 1:
        keep = CAP_DAC_READ_SEARCH
    _pr.become(libc, uid, keep)
    if keep is not None:
        return f"uid {uid} (keeps CAP_DAC_READ_SEARCH: reads any file)"
    return f"uid {uid} (from root, no capabilities)"


def _audit_hook(directory: str, net_isolated: bool):  # type: ignore[no-untyped-def]
    """The audit hook the code runs under (see the module docstring: a tripwire)."""
    import socket

    directory = os.path.realpath(directory)
    inside = directory.rstrip("/") + "/"
    allowed_files = {os.devnull, "/dev/stdout", "/dev/stderr"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                   "os.link": (1,), "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,),
                   "os.chown": (0,), "os.utime": (0,), "shutil.rmtree": (0,)}
    net_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
    realpath, fspath = os.path.realpath, os.fspath
    busy = []

    def outside(path: object) -> bool:
        if isinstance(path, int):  # an open file descriptor
            return False
        try:
            p = fspath(path)  # type: ignore[call-overload]
            if isinstance(p, bytes):
                p = os.fsdecode(p)
            real = realpath(p)
        except (TypeError, ValueError):
            return True
        return not (real == directory or real.startswith(inside) or real in allowed_files)

    def hook(event: str, args: tuple) -> None:  # type: ignore[type-arg]
        if busy:  # realpath's own calls
            return
        busy.append(1)
        try:
            if event == "open":
                path, mode, flags = args
                writes = any(c in mode for c in "wax+") if isinstance(mode, str) \
                    else bool((flags or 0) & write_flags)
                if writes and outside(path):
                    raise PermissionError(errno.EACCES, "the python tool writes only inside its "
                                          "working directory", str(path))
            elif event in path_events:
                for i in path_events[event]:
                    if i < len(args) and outside(args[i]):
                        raise PermissionError(errno.EACCES, "the python tool changes files "
                                              "only inside its working directory", str(args[i]))
            elif event == "os.killpg" or event == "os.kill" and args[0] <= 0:
                # a group or everything it may signal (as the worker's uid without a PID
                # namespace, that includes the worker)
                raise PermissionError(errno.EPERM, "the python tool signals single processes "
                                      "only")
            elif event in net_events or (
                    event == "socket.__new__" and not net_isolated
                    and args[1] not in (socket.AF_UNIX, -1)):
                raise PermissionError(errno.EACCES, "network access is disabled in the python "
                                      "tool")
        finally:
            busy.pop()

    return hook


def _flag(shared: object, i: int) -> None:
    try:
        shared[i] = 1  # type: ignore[index]
    except (ValueError, IndexError, TypeError):
        pass


def _note(exc: BaseException, shared: object) -> None:
    """Mark the limits an uncaught exception says were hit."""
    if isinstance(exc, MemoryError):
        _flag(shared, FLAG_MEMORY)
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        _flag(shared, FLAG_FILE_SIZE)
    elif isinstance(exc, OSError) and exc.errno == errno.EAGAIN:  # fork, spawn
        _flag(shared, FLAG_PROCESSES)
    elif isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        _flag(shared, FLAG_PROCESSES)


def _print_traceback(exc: BaseException, tb: object) -> None:
    """Print `exc` as Python would, without this file's frames (the fork wrapper's)."""
    import traceback

    te = traceback.TracebackException(type(exc), exc, tb)  # type: ignore[arg-type]
    seen = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list(
            [f for f in t.stack if f.filename != __file__])
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    sys.stderr.write("".join(te.format()))


def _run_code(code: str, shared: object) -> int:
    """Run `code` as __main__; the exit status, tracebacks printed as Python would."""
    import builtins
    import linecache
    import traceback  # noqa: F401 - loaded before the code runs, which may then break imports

    linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
    status = 0
    try:
        exec(compile(code, CODE_FILENAME, "exec"),
             {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException as e:
        _note(e, shared)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != CODE_FILENAME:
            tb = tb.tb_next  # this runner's frames are not the code's
        try:
            _print_traceback(e, tb)
        except BaseException:  # e.g. MemoryError again
            sys.stderr.write(f"{type(e).__name__}\n")
        status = 1
    import threading

    for t in threading.enumerate():  # what the interpreter's exit would wait for
        if t is not threading.current_thread() and not t.daemon:
            try:
                t.join()
            except BaseException:
                pass
    return status


def _child(spec: dict, status_fd: int, shared: object, root: bool, net: bool, pidns: bool,
           mnt: bool, group: object) -> None:
    """The forked child: limits, identity, directory, hook; then the code. Never returns."""
    import resource

    try:
        os.close(status_fd)
        if group is not None:  # first: what it allocates from here on is charged there
            group.enter()  # type: ignore[attr-defined]
        libc = _libc()
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()  # its own session and group: kill(0) and killpg reach only the code
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        files, private = "the host's (no mount namespace)", False
        if mnt:  # (as root in this namespace: the real one or that of a new user namespace)
            try:
                if libc.unshare(ctypes.c_int(CLONE_NEWNS)) != 0:
                    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): " +
                                  os.strerror(ctypes.get_errno()))
                files = _pr.private_root(libc, spec["dir"], spec["memory_mb"],
                                         spec.get("site_dirs", []), proc=pidns)
                private = True
            except OSError as e:
                if spec.get("require_isolation"):
                    raise OSError(e.errno, f"the python tool's private root: {e}") from None
                files = f"the host's (private root failed: {e})"
        shared[_FILES_AT:_FILES_AT + 256] = files.encode()[:256].ljust(256)  # type: ignore
        if root:
            user = _drop_root(libc, int(spec["uid"]), private)
            _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # (the uid change cleared it)
        else:  # in a user namespace, the capabilities it gave: none left
            _pr.drop_bounding_set(libc)
            _pr.clear_capabilities(libc)
            user = "own uid (no capabilities)"
        shared[_USER_AT:_USER_AT + 64] = user.encode()[:64].ljust(64)  # type: ignore[index]
        _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
        mb = 1 << 20
        cpu = int(spec["cpu_s"])
        for what, soft, hard in (
                (resource.RLIMIT_CORE, 0, 0),
                (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU, then SIGKILL a second later
                (resource.RLIMIT_DATA, spec["memory_mb"] * mb, spec["memory_mb"] * mb),
                # the address space too, generously: shared mappings are not "data"
                (resource.RLIMIT_AS, 4 * spec["memory_mb"] * mb, 4 * spec["memory_mb"] * mb),
                (resource.RLIMIT_FSIZE, spec["file_mb"] * mb, spec["file_mb"] * mb),
                (resource.RLIMIT_NOFILE, 256, 256)):
            resource.setrlimit(what, (soft, hard))
        if root:  # RLIMIT_NPROC counts the uid's tasks everywhere: this one and what it forks
            n = count_tasks(int(spec["uid"])) - 1 + int(spec["max_processes"])
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        # a file over the limit: write() fails with EFBIG (reported) instead of a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

        def out_of_cpu(signum: int, frame: object) -> None:
            # The first process of a PID namespace ignores SIGXCPU's default action: without
            # this it would run on to the hard limit, a second later, and die of SIGKILL.
            _flag(shared, FLAG_CPU)
            os._exit(128 + signal.SIGXCPU)

        signal.signal(signal.SIGXCPU, out_of_cpu)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(spec["dir"])
        sys.argv = [CODE_FILENAME]
        sys.dont_write_bytecode = True
        real_fork = os.fork

        def fork() -> int:
            try:
                return real_fork()
            except BlockingIOError:
                _flag(shared, FLAG_PROCESSES)
                raise

        os.fork = fork
        sys.addaudithook(_audit_hook(spec["dir"], net))
    except BaseException as e:
        _flag(shared, FLAG_SETUP)
        why = f"{type(e).__name__}: {e}".encode()[:_ERROR_LEN]
        shared[_ERROR_AT:_ERROR_AT + len(why)] = why  # type: ignore[index]
        os._exit(EXIT_SETUP_FAILED)
    status = 125
    try:
        status = _run_code(spec["code"], shared)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(status if 0 <= status < 256 else 1)


def _wait(child: int, deadline: float) -> tuple[int | None, object, bool]:
    """Wait for `child` until `deadline`: (wait status or None, rusage, timed out)."""
    try:
        pidfd = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None
    import select

    try:
        while True:
            pid, st, ru = os.wait4(child, os.WNOHANG)
            if pid:
                return st, ru, False
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None, True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.02))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def supervise(spec: dict, status_fd: int) -> dict:
    """The supervisor's whole job (module docstring). Returns the status it reports."""
    import mmap

    status: dict = {"exit_code": None, "signal": None, "cpu_s": 0.0, "timed_out": False,
                    "stopped": False, "limits": [], "setup_error": None, "isolation": {}}
    root = os.geteuid() == 0
    libc = _libc()
    net = pidns = mnt = False
    nproc = "uid of its own" if root else "uid-wide count"
    wanted = spec.get("namespaces", True)
    if not root:
        # RLIMIT_NPROC: this process and the code's, in a user namespace of their own where the
        # kernel counts per namespace; else the uid's tasks now plus max_processes (counted
        # before the namespace, whose /proc view shows other tasks' uids as unmapped)
        n = int(spec["max_processes"])
        uid_wide = count_tasks(os.getuid()) + n
        ids = os.getuid(), os.getgid()
        if wanted and libc.unshare(ctypes.c_int(CLONE_NEWUSER)) == 0:
            _pr.map_own_ids(*ids)  # (unmapped, it could create no file: the private root)
            # (its test fork before the PID namespace: a fork there would be its first process)
            if _limit_processes_in_user_namespace(n + 1):
                nproc = "per user namespace"
            net, pidns, mnt = _unshare(libc)
        # not inspectable by the code, which has the same uid (/proc/<pid>/fd: the status
        # pipe); after the id maps, which a process that is not dumpable cannot write
        _prctl(libc, PR_SET_DUMPABLE, 0)
        if nproc == "uid-wide count":
            import resource

            resource.setrlimit(resource.RLIMIT_NPROC, (uid_wide, uid_wide))
    elif wanted:  # root needs no user namespace to make the others
        net, pidns, mnt = _unshare(libc)
    status["isolation"] = {
        "network": "network namespace" if net else "sockets refused by an audit hook",
        "processes": "pid namespace" if pidns else "session and subreaper",
        "process_limit": nproc,
    }
    if spec.get("require_isolation") and not (net and pidns and mnt):
        # an audit hook is no boundary (ctypes passes it): without these namespaces model code
        # reached the launcher's socket (and, without a mount namespace, the run's keys); it
        # does not run unless the user opted in
        missing = [what for what, ok in (("network", net), ("PID", pidns), ("mount", mnt))
                   if not ok]
        status["setup_error"] = (
            f"the kernel refused the {_and(missing)} namespaces, which the "
            "python tool needs to isolate model code; the code was not run (set "
            "rollout.python_tool.allow_unsafe = true to run it without them)")
        status["isolation"]["user"] = "none: not run"
        return status
    try:
        _prctl(libc, PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        status["isolation"]["processes"] = "session only"
    if spec.get("site_dirs"):  # python_tool.site_packages: the worker's installed packages
        import site

        for d in spec["site_dirs"]:
            site.addsitedir(d)
    shared = mmap.mmap(-1, 4096)  # MAP_SHARED: the child and what it forks write here
    for module in ("traceback", "linecache", "builtins", "threading", "resource", "socket"):
        __import__(module)  # imported here (as root, perhaps), used in the child
    # every page of the call (shared mappings and its tmpfs files too) against one limit,
    # where a memory cgroup can be made here (memcg.py); else the rlimits alone
    group, how = _memcg.MemoryGroup.make(
        f"rollmesh-call-{os.getpid()}", (int(spec["memory_mb"]) + CGROUP_HEADROOM_MB) << 20)
    status["isolation"]["memory"] = (how if group is not None else
                                     f"rlimits only: data, and 4x in address space ({how})")
    start = time.monotonic()
    child = os.fork()
    if child == 0:
        _child(spec, status_fd, shared, root, net, pidns, mnt, group)  # never returns
    try:
        # The output pipe belongs to the code: the worker's read ends when its processes end.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        st, ru, timed_out = _wait(child, start + float(spec["wall_s"]))
    except _Stop:
        st, ru, timed_out = None, None, False
        status["stopped"] = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    status["timed_out"] = timed_out
    if st is None:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, st, ru = os.wait4(child, 0)
    status["wall_s"] = round(time.monotonic() - start, 3)
    status["leftovers_killed"] = _kill_leftovers(child)
    oom_kills = 0
    if group is not None:
        oom_kills = group.oom_kills()
        if not group.remove():
            status["isolation"]["memory"] += f" (not removed: {group.path})"
    status["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)
    if os.WIFEXITED(st):
        status["exit_code"] = os.WEXITSTATUS(st)
    elif os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        status["signal"] = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
    user = bytes(shared[_USER_AT:_USER_AT + 64]).rstrip(b"\0 ").decode()
    status["isolation"]["user"] = user or "unknown"
    files = bytes(shared[_FILES_AT:_FILES_AT + 256]).rstrip(b"\0 ").decode(errors="replace")
    status["isolation"]["files"] = files or "unknown"
    if shared[FLAG_SETUP]:
        status["setup_error"] = bytes(shared[_ERROR_AT:_ERROR_AT + _ERROR_LEN]).rstrip(
            b"\0").decode(errors="replace")
    limits = [name for i, name in _FLAG_NAMES.items() if shared[i]]
    if oom_kills and "memory" not in limits:  # the kernel killed it at the cgroup's limit
        limits.insert(0, "memory")
    killed_by_cpu = status["signal"] in ("SIGXCPU", "SIGKILL") and not timed_out \
        and not status["stopped"] and status["cpu_s"] >= int(spec["cpu_s"]) - 0.05
    if killed_by_cpu and "cpu" not in limits:
        limits.insert(0, "cpu")
    if timed_out:
        limits.insert(0, "wall")
    status["limits"] = limits
    return status


def main() -> int:
    status_fd = int(sys.argv[1])
    spec_text = sys.stdin.buffer.read()

    def stop(signum: int, frame: object) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    try:
        status = supervise(json.loads(spec_text), status_fd)
    except _Stop:  # outside the wait: before the fork, or in a moment after it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _kill_leftovers(0)
        status = {"stopped": True, "setup_error": "stopped by the worker"}
    except BaseException as e:
        status = {"setup_error": f"supervisor: {type(e).__name__}: {e}"}
    os.write(status_fd, json.dumps(status).encode())
    os.close(status_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
