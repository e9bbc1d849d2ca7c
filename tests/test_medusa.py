"""Medusa: drafter files, lossless decoding, and the training pipeline on a tiny model."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.firp import FirpSettings
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.store import base_weights, load_drafter, save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.fingerprint import fingerprint
from jaxspec.tree import DynamicTree, tree_preset
from tests.conftest import one_line_error, tiny_training_args


def conversations(n=12, seed=0):
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(f"w{i}" for i in rng.integers(5, 101, k))

    return [
        {"id": str(i), "conversations": [
            {"from": "human", "value": words(8)}, {"from": "gpt", "value": words(30)},
        ]}
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tmp_path_factory, monkeypatch_module):
    """Train 12 steps, 'interrupt', then resume to 20: (drafter dir, reports, ckpt dir, the
    runs' flags but --steps)."""
    import train.features as features
    import train.medusa as medusa

    for module in (medusa, features):
        monkeypatch_module.setattr(
            module, "sharegpt_split", lambda split: conversations(seed=len(split))
        )
    tmp = tmp_path_factory.mktemp("medusa")
    common = [*tiny_training_args(tiny_ckpt[0], tmp, train_seqs=10, batch=32, save_every=4),
              "--seq-len", "64", "--heads", "3", "--overwrite"]  # fmt: skip
    first = medusa.train([*common, "--steps", "12"])
    second = medusa.train([*common, "--steps", "20"])
    return tmp / "out", first, second, tiny_ckpt[0], common


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_training_in_two_runs_evaluates_and_writes_its_card(trained):
    """The second run goes on to its 20 steps and reports; resuming to the same weights is
    tests/test_resume.py's, heads learning their targets tests/test_training_targets.py's."""
    out, first, second, *_ = trained
    assert first["steps"] == 12 and second["steps"] == 20
    acc = np.array(second["test_topk_accuracy"])
    assert acc.shape == (3, 5) and np.all(np.diff(acc, axis=1) >= 0)  # top-k is monotone
    card = (out / "CARD.md").read_text()
    assert card.startswith("# Medusa drafter")
    # the final evaluation decodes held-out prompts with the written drafter
    measured = second["accepted_per_step"]
    assert list(measured) == ["chain-1", "searched-64"] and min(measured.values()) >= 1.0
    assert card.count("## Accepted tokens measured by the trainer") == 1
    assert f"| `searched-64` | {measured['searched-64']:.2f} |" in card
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["method"] == "medusa" and meta["settings"]["n_heads"] == 3
    assert set(meta["settings"]["trees"]) == {
        "searched-8",
        "searched-16",
        "searched-32",
        "searched-64",
    }


def test_a_finished_run_run_again_reports_what_it_measured(trained):
    """The same command after the last step trains nothing and writes the drafter again,
    with the losses and minutes its training measured (not zeros)."""
    import train.medusa as medusa

    out, _, second, _, common = trained
    again = medusa.train([*common, "--steps", "20"])
    for key in ("steps", "final_loss_per_head", "train_minutes", "test_topk_accuracy"):
        assert again[key] == second[key], key
    card = (out / "CARD.md").read_text()
    assert f"Final training loss per head: {second['final_loss_per_head']}" in card
    for record in (out.parent / "work").rglob("record.json"):  # a run finished before records
        record.unlink()
    assert "final_loss_per_head" not in medusa.train([*common, "--steps", "20"])


def test_init_starts_from_a_trained_drafter(trained, tmp_path):
    """--init DIR: training starts from that drafter's weights (with lr 0 one step keeps
    them exactly; fresh heads would be zeros); a drafter of another shape is refused."""
    import train.medusa as medusa

    out, _, _, ckpt, _ = trained
    cfg, params = load_checkpoint(ckpt)
    common = [*tiny_training_args(ckpt, tmp_path, train_seqs=10, batch=32, lr=0),
              "--seq-len", "64", "--steps", "1", "--init", str(out), "--overwrite"]  # fmt: skip
    medusa.train([*common, "--heads", "3"])
    start = load_drafter(out, "medusa", cfg).params
    after = load_drafter(tmp_path / "out", "medusa", cfg).params
    assert float(jnp.abs(start["heads"][0]["w"]).max()) > 0
    jax.tree.map(np.testing.assert_array_equal, after, start)
    card = (tmp_path / "out" / "CARD.md").read_text()
    assert f"Started from the weights of the drafter then at `{out}`, which `jaxspec-train" in card
    assert base_weights(tmp_path / "out") == fingerprint(SimpleNamespace(cfg=cfg, params=params))
    with pytest.raises(JaxspecError, match="do not fit the drafter these flags build"):
        medusa.train([*common, "--heads", "2"])


def test_heads_with_their_own_lm_head_train_and_stay_lossless(trained, tmp_path):
    """--own-lm-head (Medusa-1's form): each head's projection starts as the base lm_head,
    is trained, is written with the settings that rebuild it, and decodes losslessly."""
    import train.medusa as medusa

    _, _, _, ckpt, _ = trained
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    medusa.train([*tiny_training_args(ckpt, tmp_path, train_seqs=10, batch=32, lr=0.01),
                  "--seq-len", "64", "--steps", "4", "--heads", "2", "--own-lm-head"])  # fmt: skip
    settings, dparams, _ = load_drafter(tmp_path / "out", "medusa", cfg)
    assert settings.own_lm_head
    base = params["embed_tokens"].T if cfg.tie_embeddings else params["lm_head"]
    for head in dparams["heads"]:
        assert head["lm_head"].shape == base.shape
        assert 0 < float(jnp.abs(head["lm_head"] - base).max()) < 0.5  # trained, from lm_head
    assert "its own vocabulary projection" in (tmp_path / "out" / "CARD.md").read_text()
    drafter = MedusaDrafter(cfg, settings.n_heads, settings.own_lm_head)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    spec = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset("chain-2"))
    assert spec.generate(prompt, 30).token_ids == ar


def test_self_data_is_the_models_greedy_answer(trained):
    out, _, _, ckpt, _ = trained
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    work = out.parent / "work"  # --work-dir holds the answers, nothing goes beside it
    assert not list(out.parent.glob("*.npz"))
    data = dict(np.load(next(work.glob("self-train-*.npz"))))
    rows = zip(data["tokens"], data["starts"], data["lengths"], strict=True)
    for tokens, start, length in list(rows)[:3]:
        prompt = tokens[:start].tolist()
        ar = SpeculativeGenerator(cfg, params).generate(prompt, 24).token_ids
        assert tokens[start:length].tolist() == ar


def test_trained_medusa_is_lossless(trained):
    out, _, _, ckpt, _ = trained
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    settings, dparams, _ = load_drafter(out, "medusa", cfg)
    drafter = MedusaDrafter(cfg, settings.n_heads)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    for tree in ("chain-4", "cpu-8", "cpu-16"):
        if tree_preset(tree).max_depth > 3:
            with pytest.raises(JaxspecError, match="exceeds the drafter's 3 Medusa heads"):
                SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree)).generate(
                    prompt, 5
                )
            continue
        spec = SpeculativeGenerator(cfg, params, drafter, dparams, tree_preset(tree))
        assert spec.generate(prompt, 30).token_ids == ar


def test_trained_medusa_carries_its_calibration_into_dynamic_trees(trained):
    out, _, second, ckpt, _ = trained
    cfg, params = load_checkpoint(ckpt, jnp.float32)
    settings, dparams, _ = load_drafter(out, "medusa", cfg)
    drafter = MedusaDrafter.from_settings(cfg, settings)
    assert len(drafter.calibration) == 3 and second["calibration"] == [
        list(pair) for pair in drafter.calibration
    ]
    assert all(slope > 0 for slope, _ in drafter.calibration)
    prompt = [5, 9, 11, 30, 7]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 30).token_ids
    spec = SpeculativeGenerator(cfg, params, drafter, dparams, DynamicTree(8, 3, 4))
    assert spec.generate(prompt, 30).token_ids == ar


def test_untrained_heads_copy_the_base_prediction(tiny_ckpt):
    """Zero-initialised heads give the base model's own next-token logits (Medusa's init)."""
    cfg, params = load_checkpoint(tiny_ckpt[0], jnp.float32)
    drafter = MedusaDrafter(cfg, 2)
    h = jax.random.normal(jax.random.key(0), (3, cfg.dim))
    from jaxspec.llama import lm_logits

    logits = drafter.head_logits(params, drafter.init(params), h)
    np.testing.assert_allclose(logits[:, 1], lm_logits(params, cfg, h[:, None])[:, 0], atol=1e-5)


def test_drafter_errors(trained, tmp_path):
    out, _, _, ckpt, _ = trained
    cfg, _ = load_checkpoint(ckpt)
    with pytest.raises(JaxspecError, match="no drafter at .*jaxspec-train medusa"):
        load_drafter(tmp_path / "none", "medusa", cfg)
    other = tmp_path / "other"
    shutil.copytree(out, other)
    meta = json.loads((other / "drafter.json").read_text())
    meta["base_model"].update(dim=4096, name="Llama-2-7B")
    (other / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(JaxspecError, match="trained for 'Llama-2-7B'.*not for"):
        load_drafter(other, "medusa", cfg)
    shutil.copytree(out, tmp_path / "corrupt")
    (tmp_path / "corrupt" / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(JaxspecError, match="corrupt drafter weights"):
        load_drafter(tmp_path / "corrupt", "medusa", cfg)
    save_drafter(tmp_path / "firp", "firp", FirpSettings(layers=(1,)), {"w": np.zeros(2)}, cfg, "")
    with pytest.raises(JaxspecError, match="holds a 'firp' drafter"):
        load_drafter(tmp_path / "firp", "medusa", cfg)


def test_generate_cli_medusa(trained, capsys):
    from infer.generate import main

    out, _, _, ckpt, _ = trained
    base = ["--model", str(ckpt), "--json", "--max-new-tokens", "16", "w5 w9 w7"]
    main(base)
    ar = json.loads(capsys.readouterr().out)
    main([*base, "--method", "medusa", "--drafter", str(out), "--tree", "cpu-8"])
    medusa = json.loads(capsys.readouterr().out)
    assert medusa["token_ids"] == ar["token_ids"]
    err = one_line_error(
        main, [*base, "--method", "medusa", "--drafter", str(out), "--tree", "chain-4"], capsys
    )
    assert "tree depth 4 exceeds the drafter's 3 Medusa heads" in err


def test_bench_runs_a_given_drafter(trained, tmp_path, capsys):
    from infer.bench import main

    out, _, _, ckpt, _ = trained
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["w5 w9 w7"]}\n')
    argv = ["--model", str(ckpt), "--questions", str(questions), "--max-new-tokens", "12"]
    result = tmp_path / "r.json"
    rows = ["--methods", "ar,medusa@cpu-8", "--drafter", f"medusa={out}"]
    main([*argv, *rows, "--out", str(result)])
    got = json.loads(result.read_text())
    assert got["methods"]["medusa@cpu-8"]["match_ar"] == 1.0
    assert got["drafters"] == {"medusa": str(out)}
    for drafter, message in [
        (str(out), "write METHOD=DIR"),
        (f"ar={out}", "'ar' is not a method with a drafter"),
        (f"firp={out}", "no firp row in --methods"),
        (f"medusa={tmp_path}", "no drafter at"),
    ]:
        err = one_line_error(main, [*argv, "--methods", "medusa", "--drafter", drafter], capsys)
        assert message in err
    twice = ["--drafter", f"medusa={out}", "--drafter", f"medusa={tmp_path}"]
    err = one_line_error(main, [*argv, "--methods", "medusa", *twice], capsys)
    assert "--drafter medusa is given twice" in err
    assert "names no rows" in one_line_error(main, [*argv, "--methods", " , "], capsys)


def test_bench_rows_with_a_label_run_their_own_drafter(trained, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    from infer.bench import main

    out, _, _, ckpt, _ = trained
    zeroed = tmp_path / "zeroed"  # the same drafter with every weight zero: other drafts
    shutil.copytree(out, zeroed)
    weights = load_file(zeroed / "drafter.safetensors")
    save_file({k: np.zeros_like(v) for k, v in weights.items()}, zeroed / "drafter.safetensors")
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["w5 w9 w7"]}\n')
    rows = "ar,medusa@cpu-8,medusa#zero@cpu-8"
    argv = ["--model", str(ckpt), "--questions", str(questions), "--max-new-tokens", "16",
            "--methods", rows, "--drafter", f"medusa={out}"]  # fmt: skip
    result = tmp_path / "r.json"
    main([*argv, "--drafter", f"medusa#zero={zeroed}", "--out", str(result)])
    got = json.loads(result.read_text())
    shipped, zero = got["methods"]["medusa@cpu-8"], got["methods"]["medusa#zero@cpu-8"]
    assert shipped["match_ar"] == zero["match_ar"] == 1.0
    assert shipped["mean_accepted"] != zero["mean_accepted"]
    assert got["drafters"] == {"medusa": str(out), "medusa#zero": str(zeroed)}
    err = one_line_error(main, argv, capsys)
    assert "medusa#zero rows: name their drafter with --drafter medusa#zero=DIR" in err
    err = one_line_error(main, [*argv[:-4], "--methods", "ar,medusa#@cpu-8"], capsys)
    assert "a label expected after #" in err


def test_bench_verifies_with_typical_acceptance_when_asked(trained, tmp_path, capsys):
    from infer.bench import main

    out, _, _, ckpt, _ = trained
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["w5 w9 w7"]}\n')
    argv = ["--model", str(ckpt), "--questions", str(questions), "--max-new-tokens", "12",
            "--methods", "ar,medusa@cpu-8", "--drafter", f"medusa={out}"]  # fmt: skip
    err = one_line_error(main, [*argv, "--typical"], capsys)
    assert "typical (--typical) needs sampling" in err
    result = tmp_path / "r.json"
    # Near-greedy sampling: typical acceptance keeps only the top token, AR samples it too.
    main([*argv, "--typical", "--temperature", "0.0001", "--out", str(result)])
    got = json.loads(result.read_text())
    assert got["typical"] is True and got["temperature"] == 0.0001
    assert got["methods"]["medusa@cpu-8"]["match_ar"] == 1.0


def test_held_out_prompts_end_where_answers_start():
    from train.acceptance import held_out_prompts

    tokens = np.arange(24).reshape(3, 8)
    lengths = np.array([8, 6, 4])
    with_answers = {"tokens": tokens, "lengths": lengths, "starts": np.array([3, 2, 1])}
    assert held_out_prompts(with_answers, 2) == [[0, 1, 2], [8, 9]]
    assert held_out_prompts({"tokens": tokens, "lengths": lengths}) == [
        [0, 1, 2, 3], [8, 9, 10], [16, 17]
    ]  # fmt: skip


def test_dynamic_trees_take_each_heads_guesses_at_its_depth_calibrated():
    """A dynamic tree from random heads with a calibration is select_nodes' choice over
    head d's own logits at depth d (computed here by hand), calibrated: head d guesses
    depth d, and the calibration moves nodes."""
    from jaxspec.drafters.base import DraftInputs
    from jaxspec.llama import final_norm, vocab_projection
    from jaxspec.topology import select_nodes
    from tests.test_speculative import tiny

    cfg, params = tiny()
    calibration = ((0.9, -0.3), (0.4, -1.5), (1.5, 0.2))
    drafter = MedusaDrafter(cfg, 3, calibration=calibration)
    keys = jax.random.split(jax.random.key(1), 7)
    heads = [
        {"w": 0.5 * jax.random.normal(keys[2 * i], (cfg.dim, cfg.dim)),
         "b": 0.5 * jax.random.normal(keys[2 * i + 1], (cfg.dim,))}
        for i in range(3)
    ]  # fmt: skip
    hidden = jax.random.normal(keys[6], (2, cfg.dim))
    x = final_norm(params, cfg, hidden)
    by_hand = jnp.stack([vocab_projection(params, cfg, x + jax.nn.silu(x @ h["w"] + h["b"]))
                         for h in heads], 1)  # fmt: skip
    tree = DynamicTree(10, 3, 4)
    inputs = DraftInputs({cfg.n_layers: hidden}, jnp.zeros(2, jnp.int32), jnp.array([4, 4]))
    draft = drafter.propose(params, {"heads": heads}, tree, inputs, None)
    want = select_nodes(by_hand, tree, calibration=calibration)
    for got, expected in zip(jax.tree.leaves(draft), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)
    raw = select_nodes(by_hand, tree)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(raw), jax.tree.leaves(want), strict=True)
    )
