"""The sandbox for untrusted programs: one hostile program per property it must hold."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from jaxspec import sandbox
from jaxspec.sandbox import network_isolated, run_untrusted

SPAWN = 'import subprocess\nprint(subprocess.Popen(["sleep", "60"]{}).pid, flush=True)\n'


def _alive(pid: int) -> bool:
    """Whether `pid` is running, waiting up to 2 s for a killed one to go (zombies count as
    gone: the container's init may be slow to reap them)."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] in "ZX":
            return False
        time.sleep(0.02)
    return True


def _namespaces_allowed() -> bool:
    """Asked apart from the sandbox: whether a process may unshare a network namespace (as
    root directly, otherwise with a user namespace)."""
    flags = 0x40000000 if os.geteuid() == 0 else 0x50000000
    code = f"import ctypes, sys\nsys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_parents_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("JAXSPEC_SANDBOX_SECRET", "hunter2")
    result = run_untrusted("import json, os\nprint(json.dumps(dict(os.environ)))\n")
    env = json.loads(result.stdout_tail)
    assert "JAXSPEC_SANDBOX_SECRET" not in env
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"}


def test_home_and_cwd_are_a_fresh_temp_dir_removed_afterwards():
    source = (
        "import json, os\nopen('left-behind', 'w').write('x')\n"
        "print(json.dumps([os.getcwd(), os.environ['HOME'], os.environ['TMPDIR']]))\n"
    )
    cwd, home, tmp = json.loads(run_untrusted(source).stdout_tail)
    assert cwd == home == tmp != os.getcwd()
    assert Path(cwd).parent == Path(tempfile.gettempdir()).resolve()
    assert not Path(cwd).exists()
    assert json.loads(run_untrusted(source).stdout_tail)[0] != cwd


def test_the_program_runs_under_the_limits_asked_for_and_its_outputs_tails_come_back():
    source = (
        "import resource, sys\nR = resource\nsys.stdout.write('o' * 5000 + 'END\\n')\n"
        "print([R.getrlimit(getattr(R, 'RLIMIT_' + n))[1] "
        "for n in ('CPU', 'AS', 'FSIZE', 'NPROC', 'CORE')])\nsys.stderr.write('e' * 5000 + 'ERR')\n"
    )
    result = run_untrusted(source, cpu_s=2.5, memory_mb=300, file_mb=3, max_processes=20)
    limits = [3, 300 << 20, 3 << 20, 20, 0]  # whole CPU seconds, rounded up
    assert result.stdout_tail == ("o" * 5000 + f"END\n{limits}\n")[-4096:]
    assert result.stderr_tail == ("e" * 5000 + "ERR")[-4096:]


def test_a_lower_hard_limit_of_the_parent_is_kept():
    """A parent whose hard limit is below the one asked for (ulimit -H) still runs programs,
    under its own limit."""
    code = (
        "import resource, runpy\nresource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        f"sandbox = runpy.run_path({str(Path(sandbox.__file__))!r}, run_name='sandbox')\n"
        "r = sandbox['run_untrusted']('import resource\\n"
        "print(resource.getrlimit(resource.RLIMIT_FSIZE))\\n', file_mb=16)\n"
        "print(r.returncode, r.stdout_tail.strip())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout == f"0 {(1 << 20, 1 << 20)}\n", done.stderr


def test_a_busy_loop_is_killed_at_the_cpu_limit():
    result = run_untrusted("while True:\n    pass\n", timeout_s=30, cpu_s=1)
    assert result.returncode == -signal.SIGKILL and not result.timed_out  # before the 30 s


def test_an_idle_program_is_killed_at_the_wall_clock_timeout():
    result = run_untrusted("import time\ntime.sleep(60)\n", timeout_s=1)
    assert result.timed_out and result.returncode == -signal.SIGKILL


def test_memory_beyond_the_limit_cannot_be_allocated_while_the_parent_is_unlimited():
    parent_limit = resource.getrlimit(resource.RLIMIT_AS)
    source = "a = bytearray(32 << 20)\nprint('small ok', flush=True)\nb = bytearray(512 << 20)\n"
    result = run_untrusted(source, memory_mb=256)
    assert result.stdout_tail == "small ok\n"
    assert result.returncode == 1 and "MemoryError" in result.stderr_tail
    assert resource.getrlimit(resource.RLIMIT_AS) == parent_limit
    assert len(bytearray(512 << 20)) == 512 << 20


def test_a_file_beyond_the_size_limit_cannot_be_written():
    source = (
        "open('small', 'wb').write(bytes(512 << 10))\nprint('small ok', flush=True)\n"
        "open('big', 'wb').write(bytes(2 << 20))\n"
    )
    result = run_untrusted(source, file_mb=1)
    assert result.stdout_tail == "small ok\n"
    assert result.returncode == 1 and "File too large" in result.stderr_tail


def test_the_number_of_processes_is_bounded():
    source = (
        "import os, time\nforked = 0\ntry:\n    for _ in range(50):\n"
        "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
        "        forked += 1\nexcept BlockingIOError:\n    pass\nprint(os.getuid(), forked)\n"
    )
    uid, forked = map(int, run_untrusted(source, max_processes=8).stdout_tail.split())
    if uid == 0:
        pytest.skip("the program ran as root (no CAP_SETUID here): Linux ignores RLIMIT_NPROC")
    assert forked < 8


@pytest.mark.parametrize("own_session", [False, True], ids=["in-group", "own-session"])
@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_no_descendant_outlives_the_run(own_session, ending):
    if own_session and not _namespaces_allowed():
        pytest.skip("no network namespace here: a descendant in its own session survives")
    source = SPAWN.format(", start_new_session=True" if own_session else "")
    if ending == "timeout":
        source += "import time\ntime.sleep(60)\n"
    result = run_untrusted(source, timeout_s=1 if ending == "timeout" else 10)
    pid = int(result.stdout_tail)
    try:
        assert result.timed_out == (ending == "timeout")
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_process_group_is_killed_even_without_a_network_namespace(monkeypatch):
    """Where no namespace can be made, killing the program's process group is all that ends
    its descendants (those in a session of their own survive, as the module says)."""
    kill_all = sandbox._kill_all
    monkeypatch.setattr(sandbox, "_kill_all", lambda pgid, netns: kill_all(pgid, ""))
    pid = int(run_untrusted(SPAWN.format("")).stdout_tail)
    try:
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_the_network_is_unreachable_even_on_loopback():
    if not _namespaces_allowed():
        pytest.skip("no process may unshare a network namespace here: the network stays")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from here
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = run_untrusted(source)
    assert result.network_isolated and network_isolated()
    assert result.returncode == 1 and "Network is unreachable" in result.stderr_tail


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox drops privileges only from root")
def test_root_runs_the_program_as_nobody_who_cannot_write_roots_files(tmp_path):
    target = tmp_path / "written"
    source = (
        "import os, re\nstatus = open('/proc/self/status').read()\n"
        "print(os.getuid(), os.getgid(), os.getgroups(), *re.findall("
        "r'(?:NoNewPrivs|CapAmb|CapEff):\\s*(\\w+)', status), flush=True)\n"
        f"open({str(target)!r}, 'w')\n"
    )
    result = run_untrusted(source)
    # nobody, group nobody and no other; root's read access alone; no way back to root
    assert result.stdout_tail == "65534 65534 [] 0000000000000004 0000000000000004 1\n"
    assert result.returncode == 1 and "PermissionError" in result.stderr_tail
    assert not target.exists()
