"""A root of its own for code that must not see the host's files (Linux, standard library only).

`rollmesh.runtime.isolation` (the python tool's supervisor, run as a script: it loads this file
by its path) and the reward sandbox (`rollmesh.rewards.sandbox`) call `private_root` in a
process that is root in a new mount namespace (the real root, or that of a new user namespace),
then drop their capabilities (`drop_bounding_set`, `clear_capabilities`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

__all__ = ["become", "clear_capabilities", "confine", "drop_bounding_set", "map_own_ids", "private_root",
           "visible_paths"]

PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 8, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
# mount(2), umount2(2); pivot_root(2) has no libc wrapper: its number per machine
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
# What the code sees of the host's files, read-only (those that exist), besides the
# interpreter's own directories: the system's programs and libraries and the few files of /etc
# that libraries read. Not /home, /root, /srv, /var, /run, /tmp: nothing of a run's directory.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
                 "/etc/passwd", "/etc/group", "/etc/nsswitch.conf")
_DEVICES = ("null", "zero", "full", "random", "urandom")


def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def map_own_ids(uid: int, gid: int) -> None:
    """In a user namespace just made: `uid` and `gid` map to themselves (and nothing else), so
    that files can be created there; setgroups is denied, as the kernel requires of an
    unprivileged gid map."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def drop_bounding_set(libc: ctypes.CDLL, keep: int | None = None) -> None:
    """Empty this process's bounding set but `keep`: setuid programs cannot give anything back
    (no_new_privs covers them too)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 40
    CAP_SETPCAP = 8  # needed to drop the others: dropped last
    for cap in [*(c for c in range(last + 1) if c != CAP_SETPCAP), CAP_SETPCAP]:
        if cap == keep:
            continue
        # (fails without CAP_SETPCAP, in a process that had no capabilities to drop)
        libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))


def clear_capabilities(libc: ctypes.CDLL, keep: int | None = None) -> None:
    """capset: no effective, permitted or inheritable capability left but `keep`."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    bits = 0 if keep is None else 1 << keep
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    data[0].effective = data[0].permitted = data[0].inheritable = bits
    if libc.capset(ctypes.byref(header), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


def _prctl(lc: ctypes.CDLL, *args: int) -> None:
    full = [*args, *([0] * (5 - len(args)))]
    if lc.prctl(ctypes.c_int(full[0]), *(ctypes.c_ulong(a) for a in full[1:])) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({args[0]}): {os.strerror(e)}")


def become(lc: ctypes.CDLL, uid: int, keep: int | None = None) -> None:
    """From root to `uid` (and gid), with no capability but `keep` (kept across exec too)."""
    drop_bounding_set(lc, keep)
    if keep is not None:
        _prctl(lc, PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # (without PR_SET_KEEPCAPS, this clears the capabilities)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(errno.EPERM, f"still uid {os.getuid()} after setresuid({uid})")
    clear_capabilities(lc, keep)
    if keep is not None:
        _prctl(lc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, keep)


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = (lambda v: None if v is None else os.fsencode(v))
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {source or fstype} on {target}: {os.strerror(e)}")


def _pivot_root(libc: ctypes.CDLL, new: str, old: str) -> None:
    import platform

    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown syscall number on "
                                    f"{platform.machine()}")
    if libc.syscall(ctypes.c_long(number), os.fsencode(new), os.fsencode(old)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"pivot_root({new}): {os.strerror(e)}")


def visible_paths(extra: list[str]) -> list[str]:
    """The host paths the code may read (existing ones, no path inside another): the system's,
    the interpreter's and `extra` (the python tool's site-packages where configured, the reward
    functions' import path)."""
    import sysconfig

    wanted = [*_SYSTEM_PATHS, sys.prefix, sys.base_prefix, sys.exec_prefix,
              sys.base_exec_prefix, os.path.dirname(sys.executable),
              os.path.dirname(os.path.realpath(sys.executable)),
              *(sysconfig.get_paths().get(k) or "" for k in ("stdlib", "platstdlib")),
              *extra]
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in wanted if p and os.path.isabs(p)}, key=len):
        if os.path.lexists(p) and p != "/" and not any(p.startswith(q.rstrip("/") + "/")
                                                      for q in out):
            out.append(p)
    return out


def private_root(libc: ctypes.CDLL, workdir: str, memory_mb: int, extra: list[str],
                 proc: bool, hide: list[str] | tuple[str, ...] = ()) -> str:
    """In this process's new mount namespace, as root there: a root of its own on a tmpfs, with
    `visible_paths` bound read-only at their paths, the code's directory read-write, the five
    harmless devices, /tmp and /dev/shm as tmpfs of the memory limit's size (files there die
    with the call), a fresh /proc of the PID namespace (`proc`), and nothing else of the host
    (old root unmounted); `hide` (a run's directory inside a visible one, say) covered by an
    empty directory. Returns a description for the status."""
    workdir = os.path.realpath(workdir)
    mb = int(memory_mb)
    visible = visible_paths(extra)
    # Links are read here, in the host's view: after the pivot an absolute link's target would
    # resolve against the new root. Every link on the way to a visible path is made again in
    # the new root, and the paths are bound where they really are (a venv under a linked
    # directory, /lib -> usr/lib, a venv's python -> /usr/bin/python3).
    links: dict[str, str] = {}
    for path in visible:
        walked = ""
        for part in path.strip("/").split("/"):
            walked += "/" + part
            if os.path.islink(walked):  # (what lies beyond it: bound with its target)
                links[walked] = os.readlink(walked)
                break
    hide = [os.path.realpath(path) for path in hide]
    real = sorted({os.path.realpath(path) for path in visible if os.path.exists(path)})
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing leaks back to the host
    # Build on a tmpfs over /tmp (private now), the host's root moved to /tmp/old; the new root
    # at /tmp/new, which becomes / in the end
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    os.mkdir("/tmp/new", 0o755)
    os.mkdir("/tmp/old", 0o755)
    _mount(libc, "/tmp/new", "/tmp/new", None, MS_BIND)
    _pivot_root(libc, "/tmp", "/tmp/old")
    os.chdir("/")

    def place(path: str, is_dir: bool) -> str:
        target = "/new" + path
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if is_dir:
            os.makedirs(target, 0o755, exist_ok=True)
        elif not os.path.lexists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        return target

    def bind(path: str, writable: bool) -> None:  # (a real path: no link on its way)
        old = "/old" + path
        target = place(path, os.path.isdir(old))
        _mount(libc, old, target, None, MS_BIND | MS_REC)
        if not writable:  # read-only, keeping the flags a user namespace may not clear
            keep = os.statvfs(target).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
            try:
                _mount(libc, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
            except OSError:
                pass  # file modes still hold: the code runs with no capabilities

    for path in ("/dev/shm", "/tmp"):  # first: the code's directory may be under /tmp
        _mount(libc, "tmpfs", place(path, True), "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=1777,size={mb}m")
    bound: list[str] = []
    for path in real:  # (sorted: a directory before what lies in it, bound with it)
        if not any((path + "/").startswith(b.rstrip("/") + "/") for b in bound):
            bind(path, writable=False)
            bound.append(path)
    for link, target in sorted(links.items()):
        if not os.path.lexists("/new" + link):  # (not inside a directory bound above)
            os.makedirs(os.path.dirname("/new" + link), 0o755, exist_ok=True)
            os.symlink(target, "/new" + link)
    bind(workdir, writable=True)
    for path in hide:
        if os.path.isdir("/new" + path):
            _mount(libc, "tmpfs", "/new" + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY,
                   "mode=0,size=4k")
        elif os.path.lexists("/new" + path):
            _mount(libc, "/old/dev/null", "/new" + path, None, MS_BIND)
    for name in _DEVICES:
        if os.path.exists("/old/dev/" + name):
            _mount(libc, "/old/dev/" + name, place("/dev/" + name, False), None, MS_BIND)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        os.symlink(f"/proc/self/fd/{fd}", "/new/dev/" + name)
    os.symlink("/proc/self/fd", "/new/dev/fd")
    proc_view = "no /proc"
    if proc:
        try:
            _mount(libc, "proc", place("/proc", True), "proc",
                   MS_NOSUID | MS_NODEV | MS_NOEXEC)
            proc_view = "its own /proc"
        except OSError:
            os.rmdir("/new/proc")
    os.mkdir("/new/.old", 0o755)
    _pivot_root(libc, "/new", "/new/.old")
    os.chdir("/")
    libc.umount2(b"/.old", ctypes.c_int(MNT_DETACH))
    os.rmdir("/.old")
    try:  # the tree's own directories: read-only
        _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    except OSError:
        pass
    return (f"private root: {len(visible)} system and interpreter paths read-only, "
            f"{proc_view}, /dev/shm and /tmp of {mb} MiB")




def _die_with(lc: ctypes.CDLL, alive_r: int) -> None:
    """SIGKILL when the parent dies; exit now if it already has (its pipe's end at EOF: from a
    PID namespace of its own, the parent is not there to ask)."""
    import select
    import signal

    _prctl(lc, PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(1)
    os.close(alive_r)


def confine(workdir: str, memory_mb: int, extra: list[str], uid: int | None,
            hide: list[str] | tuple[str, ...] = (), group: object = None) -> str:
    """Make this process a contained one (the reward sandbox's children): new user (unless
    root), network, IPC and PID namespaces, then a fork. The parent stays outside, waits, removes
    `workdir` and ends as the child ended (it never returns); the child (first process of the PID
    namespace: it sees no other process and can signal none) dies with it, makes its mount
    namespace and `private_root` (`extra` readable, `hide` covered), becomes `uid` when root
    (SANDBOX uid) with no capability, and sets no_new_privs. Returns, in the child, a
    description; raises OSError naming what the kernel refused (in the child, from the mount
    namespace on: its caller reports it and exits, and the parent with it). `group`: a
    `memcg.MemoryGroup` the child enters first, removed by the parent once the child is gone."""
    lc = libc()
    ids = os.getuid(), os.getgid()
    root = os.geteuid() == 0

    def unshare(flags: int, what: str) -> None:
        if lc.unshare(ctypes.c_int(flags)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"the kernel refused {what}: {os.strerror(e)}")

    if not root:
        unshare(CLONE_NEWUSER, "a user namespace")
        map_own_ids(*ids)
    unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID, "the network, IPC and PID namespaces")
    alive_r, alive_w = os.pipe()  # the child sees its end reach EOF once the parent is gone
    child = os.fork()
    if child:
        import shutil
        import signal

        os.closerange(0, 2)  # the protocol's pipes are the child's alone; stderr stays
        os.closerange(3, alive_w)
        os.closerange(alive_w + 1, 65536)
        _, st = os.waitpid(child, 0)
        shutil.rmtree(workdir, ignore_errors=True)
        if group is not None:
            group.remove()  # type: ignore[attr-defined]
        if os.WIFSIGNALED(st):  # end as it ended: the sandbox reports the signal
            signal.signal(os.WTERMSIG(st), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(st))
        os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)
    os.close(alive_w)
    if group is not None:  # before it allocates: every page it touches is charged there
        group.enter()  # type: ignore[attr-defined]
    unshare(CLONE_NEWNS, "a mount namespace")
    files = private_root(lc, workdir, memory_mb, extra, proc=True, hide=hide)
    if root and uid is not None:
        become(lc, uid)
        who = f"uid {uid}"
    else:
        drop_bounding_set(lc)
        clear_capabilities(lc)
        who = "own uid"
    _die_with(lc, alive_r)  # (after the uid change, which clears the parent-death signal)
    _prctl(lc, PR_SET_NO_NEW_PRIVS, 1)
    return f"{who}, no capability, no network, pid namespace, {files}"
