"""Several processes on one mesh (jax.distributed over gloo on localhost): the same tokens
as one process, printed once; and one-line errors for a malformed process group."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxspec import hosts
from jaxspec.config import preset
from jaxspec.errors import JaxspecError
from tests.conftest import NO_LLVM_OPTIMISATION

ROOT = Path(__file__).resolve().parent.parent
# heads 6, kv heads 3, FFN 96, vocabulary 105: model=3 divides them all
CFG3 = dataclasses.replace(
    preset("tiny-gqa"), n_heads=6, n_kv_heads=3, head_dim=8, dim=48, ffn_dim=96,
    vocab_size=105, eos_token_ids=(2,), name="tiny-3",
)  # fmt: skip


@pytest.mark.parametrize(
    "coordinator, n, i, message",
    [
        (None, 2, 0, "need --coordinator"),
        ("localhost", 2, 0, "expected HOST:PORT"),
        ("localhost:0", 1, 0, "port 0 is outside 1..65535"),  # it waited forever
        ("localhost:70000", 1, 0, "port 70000 is outside 1..65535"),
        (":99", 2, 0, "expected HOST:PORT"),
        ("localhost:99", None, 0, "needs --num-processes N and --process-id I"),
        ("localhost:99", 0, 0, "needs --num-processes N and --process-id I"),
        ("localhost:99", 2, 2, "--process-id 2 is outside 0..1"),
        ("localhost:99", 2, -1, "--process-id -1 is outside 0..1"),
        ("auto", 2, None, "drop --num-processes"),
    ],
)
def test_a_malformed_process_group_is_one_line(coordinator, n, i, message):
    with pytest.raises(JaxspecError, match=message):
        hosts.start(coordinator, n, i)  # checked before anything starts


def test_the_mesh_must_split_over_the_processes():
    assert hosts.local_device_count(6, 3) == 2 and hosts.local_device_count(4, None) == 4
    with pytest.raises(JaxspecError, match="4 devices does not split evenly over 3 processes"):
        hosts.local_device_count(4, 3)


def test_a_failure_to_join_is_one_line():
    """jax's refusal to join a process group (here: its backends already started) comes
    back as one line naming the coordinator."""
    jax.devices()
    refused = r"process group at 127.0.0.1:1234: jax.distributed.initialize\(\) must be called"
    with pytest.raises(JaxspecError, match=f"could not join the {refused}"):
        hosts.start("127.0.0.1:1234", 2, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # CI time (~30 s, three processes)
def test_three_processes_print_one_processes_tokens(tmp_path, capsys):
    """`jaxspec-generate --mesh data=1,model=3` over three processes (one CPU device each)
    with a Medusa drafter: process 0 prints the token ids one process gives, the others
    print nothing."""
    from infer.generate import main
    from jaxspec.checkpoint import save_checkpoint
    from jaxspec.llama import init_params
    from tests.conftest import tiny_tokenizer
    from tests.test_cli import run_ok
    from tests.test_mesh import write_medusa

    model = tmp_path / "m"
    save_checkpoint(model, CFG3, init_params(CFG3, jax.random.key(0), scale=0.3), tiny_tokenizer())
    drafter = write_medusa(tmp_path / "d", CFG3, model)
    argv = ["--model", str(model), "--method", "medusa", "--drafter", str(drafter), "--json",
            "--max-new-tokens", "12", "w5 w9 w7"]  # fmt: skip
    one = json.loads(run_ok(main, argv, capsys))

    port = free_port()
    env = {**os.environ, "XLA_FLAGS": NO_LLVM_OPTIMISATION}  # one device each
    group = ["--mesh", "data=1,model=3", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "3"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "infer.generate", *argv, *group, "--process-id", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    got = json.loads(outs[0][0])
    assert got["token_ids"] == one["token_ids"]
    assert got["weight_bytes_per_device"] < 0.4 * one["weight_bytes_per_device"]
    assert outs[1][0] == outs[2][0] == ""


FINGERPRINT = """
import json, sys
from types import SimpleNamespace
from jaxspec import hosts
hosts.start(sys.argv[1], 3, int(sys.argv[2]))
import jax
import jaxspec.config
from jaxspec.fingerprint import fingerprint
from jaxspec.llama import init_params
from jaxspec.mesh import make_mesh, shard_params
cfg = jaxspec.config.LlamaConfig(**json.loads(sys.argv[3]))
params = init_params(cfg, jax.random.key(0))
if sys.argv[4] == "split":
    params = shard_params(params, cfg, make_mesh({"data": 1, "model": 3}))
print(fingerprint(SimpleNamespace(cfg=cfg, params=params)))
"""


@pytest.mark.slow  # CI time (~15 s, three processes)
@pytest.mark.parametrize("weights", ["split", "whole"])
def test_the_weights_fingerprint_in_a_group_of_three_processes(weights):
    """Each process of a group, holding a third of every weight or all of them, computes
    the fingerprint one process does (jaxspec.fingerprint: drafters and training folders
    are checked by it)."""
    from types import SimpleNamespace

    from jaxspec.fingerprint import fingerprint
    from jaxspec.llama import init_params

    one = fingerprint(SimpleNamespace(cfg=CFG3, params=init_params(CFG3, jax.random.key(0))))
    coordinator, cfg = f"127.0.0.1:{free_port()}", json.dumps(CFG3.to_dict())
    env = {**os.environ, "XLA_FLAGS": NO_LLVM_OPTIMISATION}  # one device each
    procs = [
        subprocess.Popen([sys.executable, "-c", FINGERPRINT, coordinator, str(i), cfg, weights],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for i in range(3)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    assert [out.split()[-1] for out, _ in outs] == [one] * 3  # (gloo prints lines before)
