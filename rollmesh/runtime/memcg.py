"""A memory cgroup for one sandboxed call: the limit that counts all of its memory.

RLIMIT_DATA counts a process's heap and private mappings; it does not count an anonymous
shared mapping (`mmap(MAP_SHARED | MAP_ANONYMOUS)`: 1,500 MiB under a 512 MiB limit, issue 35)
or the pages of the call's own tmpfs (`/tmp`, `/dev/shm`), and RLIMIT_AS only bounds them
loosely (4x). A memory cgroup charges every page the call's processes touch, shared or
private, file or anonymous, to one limit: at it, the kernel reclaims what it can and then
kills a process of the group (`oom_kill` in its events), nothing outside it.

`MemoryGroup.make` creates a group beside nothing else: a child of this process's own memory
cgroup, where this process may (root, or a group delegated to the user). cgroup v1 (the
memory controller mounted on its own) and v2 (the memory controller enabled for the children
of this process's group) are both handled; elsewhere it returns None with the reason, and the
caller keeps the rlimits and says so. Swap is not counted separately (v1's memsw is often
off); v2's `memory.swap.max` is set to 0 where it exists.

Standard library only: the python tool's supervisor (`isolation.py`, run with `-I -S`) loads
this file by its path.
"""

from __future__ import annotations

import os
import time


def _own_group() -> tuple[str, int] | None:
    """(the directory of this process's memory cgroup, version), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in mounts:
        pre, _, post = line.partition(" - ")
        fields, super_fields = pre.split(), post.split()
        if len(fields) < 5 or len(super_fields) < 3:
            continue
        if super_fields[0] == "cgroup" and "memory" in super_fields[2].split(","):
            v1 = (fields[4], fields[3])  # (mount point, root of the mount)
        elif super_fields[0] == "cgroup2":
            v2 = (fields[4], fields[3])
    def under(mount: tuple[str, str], path: str) -> str:  # (mount point, the mount's root)
        rel = os.path.relpath(path, mount[1])
        return mount[0] if rel == "." else os.path.join(mount[0], rel)

    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v1 and "memory" in controllers.split(","):
            return under(v1, path), 1
        if v2 and hid == "0" and not controllers:
            return under(v2, path), 2
    return None


def remove_named(name: str, timeout_s: float = 2.0) -> bool:
    """Remove the group `name` under this process's own memory cgroup, if it is there: one a
    child made and could not remove because it was killed (a reward process killed by its
    worker, a supervisor's session killed). False if it still held a process after
    `timeout_s`."""
    own = _own_group()
    if own is None or os.sep in name or not name:
        return True
    path = os.path.join(own[0], name)
    if not os.path.isdir(path):
        return True
    return MemoryGroup(path, own[1]).remove(timeout_s)


class MemoryGroup:
    """One call's memory cgroup: `make`, `enter` (from the process to limit, before it
    allocates), `oom_kills` after, `remove` once its processes are gone."""

    def __init__(self, path: str, version: int):
        self.path, self.version = path, version

    @classmethod
    def make(cls, name: str, limit_bytes: int) -> tuple[MemoryGroup | None, str]:
        """A new group `name` under this process's own, limited to `limit_bytes`; (None, why
        not) where none can be made."""
        own = _own_group()
        if own is None:
            return None, "no memory cgroup (neither v1's memory controller nor cgroup v2)"
        parent, version = own
        if version == 2:
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        return None, ("cgroup v2 without the memory controller for this "
                                      f"process's children ({parent})")
            except OSError as e:
                return None, f"cgroup v2: {e.strerror} ({parent})"
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError as e:
            return None, f"cannot make a memory cgroup under {parent}: {e.strerror}"
        group = cls(path, version)
        try:
            if version == 1:
                group._write("memory.limit_in_bytes", str(limit_bytes))
            else:
                group._write("memory.max", str(limit_bytes))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    group._write("memory.swap.max", "0")
        except OSError as e:
            group.remove()
            return None, f"cannot limit the memory cgroup {path}: {e.strerror}"
        return group, f"memory cgroup v{version}"

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def enter(self) -> None:
        """Move the calling process into the group: what it and its children allocate from
        now on is charged to it. (A pid written is read in the writer's PID namespace.)"""
        self._write("cgroup.procs", str(os.getpid()))

    def oom_kills(self) -> int:
        """Processes the kernel killed at the group's limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Remove the group (its processes must be gone; a zombie still counts): False if it
        could not be within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
