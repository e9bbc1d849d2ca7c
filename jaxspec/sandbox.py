"""Runs untrusted Python source (model-written programs) in a throwaway sandbox.

Each run gets its own session (process group) and a fresh temp dir as cwd, HOME and TMPDIR,
removed afterwards; a scrubbed environment; stdin /dev/null; stdout and stderr in files
whose tails come back. This module, run as a script (`python -I -S sandbox.py ...`), is the
launcher: in the new process, before the program starts, it sets the rlimits, unshares the
network and drops root, then execs the program. (Doing this in a fresh process rather than
in a `preexec_fn` keeps it safe in a threaded parent such as a JAX process.)

What holds, on Linux:
- CPU seconds (RLIMIT_CPU, SIGKILL at the limit), address space (RLIMIT_AS: MemoryError),
  file size (RLIMIT_FSIZE: OSError EFBIG, also bounds the captured output) and no core
  dumps, per process; the wall-clock timeout for the whole run.
- Network: a new, empty network namespace (loopback down), when the kernel allows it: as
  root (CAP_SYS_ADMIN) directly, otherwise inside a new user namespace. If neither works
  the program keeps the network: `SandboxResult.network_isolated` and `network_isolated()`
  say so.
- No survivors: after the program exits or times out its whole process group is killed,
  and, with a network namespace (which no process can leave), every process still in it,
  so a descendant that started its own session dies too. Without the namespace such a
  descendant would survive.
- Root: Linux does not enforce RLIMIT_NPROC for root, so as root the program runs as
  nobody (65534), with no_new_privs (setuid binaries do not give root back). It keeps
  root's read access (ambient CAP_DAC_READ_SEARCH: the interpreter may live under /root)
  but cannot write root's files nor signal other users' processes; it can still write to
  world-writable dirs such as /tmp (file size bounded, not their number). RLIMIT_NPROC then
  counts every process of nobody on the machine. If root cannot change uid (no
  CAP_SETUID), the program runs as root and RLIMIT_NPROC does not hold.
- Not root: the program runs as the caller (who can write the caller's files), and
  RLIMIT_NPROC counts all of the caller's processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
TAIL_BYTES = 4096
PROGRAM = "program.py"
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CAP_DAC_READ_SEARCH = 2
CAPABILITY_VERSION_3 = 0x20080522
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
SWEEPS = 100  # passes over /proc killing what is left in the namespace, 10 ms apart


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # negative: killed by that signal (-9 on timeout or the CPU limit)
    timed_out: bool
    stdout_tail: str  # the last TAIL_BYTES bytes, decoded
    stderr_tail: str
    network_isolated: bool


def run_untrusted(
    source: str,
    timeout_s: float = 10.0,
    *,
    cpu_s: float | None = None,
    memory_mb: int = 1024,
    file_mb: int = 16,
    max_processes: int = 64,
) -> SandboxResult:
    """Run `source` as a Python program in the sandbox (see the module docstring), at most
    `timeout_s` seconds of wall clock and `cpu_s` (default: `timeout_s`) CPU seconds."""
    limits = (math.ceil(cpu_s or timeout_s), memory_mb << 20, file_mb << 20, max_processes)
    with (
        tempfile.TemporaryDirectory(prefix="sandbox-") as home,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        Path(home, PROGRAM).write_text(source)
        if os.geteuid() == 0:
            os.chown(home, NOBODY, NOBODY)  # the launcher will run the program as nobody
        proc, netns = _start(home, limits, out, err)
        try:
            timed_out = _wait(proc, timeout_s)
        finally:
            _kill_all(proc.pid, netns)
            proc.wait()
        return SandboxResult(proc.returncode, timed_out, _tail(out), _tail(err), bool(netns))


@functools.cache
def network_isolated() -> bool:
    """Whether sandboxed programs get their own network namespace on this machine."""
    return run_untrusted("").network_isolated


def _environment(home: str) -> dict[str, str]:
    """Nothing inherited. (-I makes Python ignore PYTHON* variables, so none are set.)"""
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
    }


def _start(home: str, limits: tuple[int, ...], out, err) -> tuple[subprocess.Popen, str]:
    """Start the launcher in a new session -> (its process, the program's network namespace
    or "" when it has none), once the launcher has reported on its pipe."""
    read_end, write_end = os.pipe()
    argv = [sys.executable, "-I", "-S", __file__, str(write_end), *map(str, limits)]
    with os.fdopen(read_end, "rb") as report:
        try:
            proc = subprocess.Popen(
                argv, cwd=home, env=_environment(home), stdin=subprocess.DEVNULL, stdout=out,
                stderr=err, start_new_session=True, pass_fds=(write_end,),
            )  # fmt: skip
        finally:
            os.close(write_end)
        return proc, report.read().decode()


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the program to exit -> whether it ran out of time instead."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return True
    return False


def _kill_all(pgid: int, netns: str) -> None:
    """SIGKILL the program's process group, then every process left in its network
    namespace (a descendant in a session of its own), until none is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for _ in range(SWEEPS if netns else 0):
        left = [pid for pid in _pids() if _netns(pid) == netns]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _netns(pid: int) -> str | None:
    """The network namespace of a live process; None once it is gone (or a zombie)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _tail(file) -> str:
    file.seek(max(0, file.seek(0, os.SEEK_END) - TAIL_BYTES))
    return file.read().decode(errors="replace")


# The launcher's side: runs in the new session, in the temp dir, before the program.


def _launch(report_fd: int, cpu_s: int, memory: int, file_size: int, processes: int) -> None:
    """Limit, isolate, drop root, report the network namespace, then become the program."""
    libc = ctypes.CDLL(None, use_errno=True)
    _limit(resource.RLIMIT_CPU, cpu_s)
    _limit(resource.RLIMIT_AS, memory)
    _limit(resource.RLIMIT_FSIZE, file_size)
    _limit(resource.RLIMIT_NPROC, processes)
    _limit(resource.RLIMIT_CORE, 0)
    netns = _unshare_network(libc)
    _drop_root(libc)
    os.write(report_fd, netns.encode())
    os.close(report_fd)
    # -I: no PYTHON* variables, user site or script dir on sys.path. Not -S: an answer may
    # import an installed package (numpy, say), as in the reference HumanEval harness.
    os.execv(sys.executable, [sys.executable, "-I", PROGRAM])


def _limit(which: int, value: int) -> None:
    """Soft and hard limit `value`, or the hard limit already there when lower."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _unshare_network(libc) -> str:
    """Move into a new network namespace -> its name, or "" when the kernel refuses."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    try:
        unshared = libc.unshare(flags) == 0
    except AttributeError:  # no unshare(2): not Linux
        unshared = False
    return os.readlink("/proc/self/ns/net") if unshared else ""


def _drop_root(libc) -> None:
    """As root, become nobody, keeping only root's read access across exec (as an ambient
    capability) and no way back to root. Stays root when it may not change uid."""
    if os.geteuid() != 0:
        return
    _prctl(libc, PR_SET_KEEPCAPS, 1)
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    except PermissionError:
        return
    _keep_read_access(libc)
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def _keep_read_access(libc) -> None:
    """Keep CAP_DAC_READ_SEARCH (kept in the permitted set by KEEPCAPS) alone, as an ambient
    capability, which survives exec."""
    bit = 1 << CAP_DAC_READ_SEARCH
    data = (_CapData * 2)(_CapData(bit, bit, bit))
    if libc.capset(ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH)


def _prctl(libc, option: int, *args: int) -> None:
    values = [ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:4]]
    if libc.prctl(option, *values) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


if __name__ == "__main__":
    _launch(*map(int, sys.argv[1:]))
