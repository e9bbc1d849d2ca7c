"""Several processes, one program: jax.distributed's multi-controller runtime.

Every process (one per host, or several on one host) runs the same command with its own
--process-id; their devices form one global device list that a mesh (jaxspec.mesh) spans,
and every compiled program runs on all of them at once. On CPU the processes' collectives
go through gloo. Only process 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import jax

from jaxspec.errors import JaxspecError

AUTO = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help="run as one of --num-processes processes with process 0 listening at HOST:PORT "
        "(every process runs the same command with its own --process-id); 'auto': the "
        "cluster's environment says (TPU pods, Slurm)",
    )  # fmt: skip
    parser.add_argument("--num-processes", type=int, help="with --coordinator: how many")
    parser.add_argument("--process-id", type=int, help="with --coordinator: this one, 0..N-1")


def check(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """One line naming what is missing or out of range in a process group's options."""
    given = num_processes is not None or process_id is not None
    if coordinator is None:
        if given:
            raise JaxspecError("--num-processes and --process-id need --coordinator HOST:PORT")
        return
    if coordinator == AUTO:
        if given:
            raise JaxspecError("--coordinator auto reads the process group from the environment: "
                               "drop --num-processes and --process-id")  # fmt: skip
        return
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise JaxspecError(f"--coordinator {coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    if not 1 <= int(port) <= 65535:
        raise JaxspecError(f"--coordinator {coordinator!r}: port {port} is outside 1..65535")
    if num_processes is None or process_id is None or num_processes < 1:
        raise JaxspecError("--coordinator HOST:PORT needs --num-processes N and --process-id I")
    if not 0 <= process_id < num_processes:
        raise JaxspecError(
            f"--process-id {process_id} is outside 0..{num_processes - 1} (--num-processes "
            f"{num_processes})"
        )


def start(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join the process group (nothing without a coordinator). Call before anything starts
    jax's backends."""
    check(coordinator, num_processes, process_id)
    if coordinator is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if coordinator == AUTO:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JaxspecError(f"could not join the process group at {coordinator}: {first}") from None


def local_device_count(devices: int, num_processes: int | None) -> int:
    """Devices each process provides for a mesh of `devices` over the group."""
    n = num_processes or 1
    if devices % n:
        raise JaxspecError(
            f"a mesh of {devices} devices does not split evenly over {n} processes; use a "
            "mesh whose device count is a multiple of --num-processes"
        )
    return devices // n


@contextlib.contextmanager
def printing_on_first_process() -> Iterator[None]:
    """In a process group: standard output of every process but process 0 discarded (they
    compute the same), and what native code writes to it (gloo's "[Gloo] Rank ...
    connected" lines) sent to standard error, so that stdout holds only jaxspec's output."""
    if jax.process_count() == 1:
        yield
        return
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    first = jax.process_index() == 0
    target = kept if first else os.devnull
    try:
        with (
            open(target, "w", closefd=not first, encoding=sys.stdout.encoding,
                 errors=sys.stdout.errors) as out,
            contextlib.redirect_stdout(out),
        ):  # fmt: skip
            yield
    finally:
        os.dup2(kept, 1)
        os.close(kept)
