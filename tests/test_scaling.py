"""Scaling on paper (issue 30): the per-device bytes and step times `jaxspec.scaling`
predicts agree with hand-written formulas; the CLI prints its tables. Pure arithmetic:
nothing is compiled."""

from __future__ import annotations

import dataclasses
import json

import pytest

from infer.scaling import main
from jaxspec.config import LlamaConfig, preset
from jaxspec.errors import JaxspecError
from jaxspec.scaling import (
    ACCELERATORS,
    DTYPES,
    Accelerator,
    Dtypes,
    allreduce_bytes,
    cache_bytes,
    fits,
    logits_gather_bytes,
    model_config,
    predict_step,
    speedup,
    weight_bytes,
)

SMALL = LlamaConfig(
    vocab_size=96, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=40, name="small"
)


def test_weight_bytes_tp1_is_two_bytes_per_param():
    cfg = preset("llama-3-8b")
    assert weight_bytes(cfg, 1) == 2 * cfg.n_params == 2 * 8_030_261_248


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_weight_bytes_split_all_but_norms(tp):
    cfg = preset("llama-3-8b")
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert weight_bytes(cfg, tp) == 2 * ((cfg.n_params - norms) // tp + norms)
    assert weight_bytes(cfg, tp) == pytest.approx(2 * cfg.n_params / tp, rel=1e-3)


def test_cache_bytes_split_by_kv_heads():
    # keys and values, 3 layers of [B=2, K/TP=1, S=10, H=4], float32
    assert cache_bytes(SMALL, 2, batch=2, context=10) == 2 * 3 * 2 * 1 * 10 * 4 * 4
    assert cache_bytes(SMALL, 1, 2, 10, Dtypes(cache=2)) == 2 * 3 * 2 * 2 * 10 * 4 * 2


def test_allreduce_and_gather_bytes_by_hand():
    # 5 rows x dim 16 float32 = 320 bytes an all-reduce; a ring over 4 sends 2*3/4 of it;
    # 2 per layer x 3 layers + the embedding's = 7 all-reduces
    assert allreduce_bytes(SMALL, 4, rows=5) == 7 * 1.5 * 320
    assert logits_gather_bytes(SMALL, 4, rows=5) == 0.75 * 5 * 96 * 4
    assert allreduce_bytes(SMALL, 1, rows=5) == logits_gather_bytes(SMALL, 1, 5) == 0
    # a step's: all-reduces of 5 rows (ring over 2: 320 bytes each) and the logits gathered
    s = predict_step(SMALL, ACCELERATORS["h100"], 2, batch=1, tokens=5, context=10)
    assert s.allreduce_bytes == 7 * 320 and s.comm_bytes == 7 * 320 + 0.5 * 5 * 96 * 4


def test_step_time_is_max_of_memory_and_compute_plus_comm():
    acc = Accelerator("paper", 1e12, 1e9, 1e12, 1e8, 1e-6)
    s = predict_step(SMALL, acc, 2, batch=1, tokens=5, context=10)
    assert s.memory_s == (s.weight_bytes + s.cache_bytes) / 1e9
    assert s.compute_s == s.flops / 1e12
    assert s.comm_s == pytest.approx(s.comm_bytes / 1e8 + (2 * 3 + 2) * 1e-6)
    assert s.seconds == max(s.memory_s, s.compute_s) + s.comm_s
    # 2 FLOPs x 3 passes per row per multiplied weight: q,k,v,o,gate,up,down and lm_head
    # split 2 ways, not the embedding or the norms
    per_layer = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 40
    assert s.flops == 2 * 3 * 5 * (3 * per_layer + 16 * 96) / 2
    # tied embeddings: the embedding is the output projection, as many weights multiplied
    tied = predict_step(dataclasses.replace(SMALL, tie_embeddings=True), acc, 2, 1, 5, 10)
    assert tied.flops == s.flops
    # one device: no collectives, nothing to send
    one = predict_step(SMALL, acc, 1, batch=1, tokens=5, context=10)
    assert one.collectives == 0 and one.comm_s == 0 and one.seconds == one.memory_s


def test_70b_fits_h100_at_tp8_not_tp1():
    cfg, h100 = model_config("llama-3-70b"), ACCELERATORS["h100"]
    assert cfg.n_params == 70_553_706_496
    assert not fits(predict_step(cfg, h100, 1, 1, 1, 2048), h100)
    assert fits(predict_step(cfg, h100, 8, 1, 1, 2048), h100)
    # the cache counts too: 17.6 GB of weights and 2 x 80 layers x [128, 1, 8192, 128]
    # float32 keys and values (86 GB) a device at TP 8
    assert not fits(predict_step(cfg, h100, 8, 128, 1, 8192), h100)


def test_speedup_sanity():
    cfg, acc = preset("llama-3-8b"), ACCELERATORS["h100"]
    ar = predict_step(cfg, acc, 1, 1, 1, 2048)
    assert speedup(1.0, ar, ar) == 1.0
    verify = predict_step(cfg, acc, 8, 1, 32, 2048, DTYPES)
    assert speedup(2.0, predict_step(cfg, acc, 8, 1, 1, 2048), verify) < 2.0


def test_tp_must_divide_the_split_sizes():
    with pytest.raises(JaxspecError, match="TP=0: the model axis needs at least 1 device"):
        weight_bytes(SMALL, 0)
    with pytest.raises(JaxspecError, match="n_kv_heads 8"):
        weight_bytes(preset("llama-3-8b"), 16)
    with pytest.raises(JaxspecError, match="unknown model"):
        model_config("llama-3-400b")


def test_cli_prints_tables_and_json(capsys, tmp_path):
    out = tmp_path / "scaling.json"
    main(["--models", "llama-3-70b", "--tp", "1", "8", "--accelerators", "h100",
          "--tau", "chimera:32:2.16", "--json", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert "| Llama-3-70B | H100 SXM | 1 | 141.11 | 1.34 | no |" in text
    assert "| Llama-3-70B | H100 SXM | 8 | 17.64 | 0.17 | yes |" in text
    assert "chimera (32 nodes, τ 2.16)" in text
    records = json.loads(out.read_text())
    assert [r["tp"] for r in records] == [1, 8]
    assert set(records[1]["speedups"]) == {"chimera"}


def test_cli_bad_tau_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--tau", "chimera:x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "LABEL:NODES:TAU" in err and err.count("\n") == 1
