"""`icml gradient-route` end to end through the CLI at a test-sized config built from the smoke preset:
every variant, metric and extra table lands, the baseline's CR is 1, the report renders, a profile
exports as a plain GPT-2 checkpoint, user folders and a local GPT-2 train, bad input is one line."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import train_eval_report
from icml.methods.gradient_route.config import VARIANTS

TINY = ["--preset", "smoke", "--set", "gpt.n_embd=16", "--set", "gpt.n_layer=1", "--set", "gpt.n_head=2",
        "--set", "gpt.context=16", "--set", "d_dense=32", "--set", "d_core=24", "--set", "d_aux=8",
        "--set", "steps=8", "--set", "cr.eval_every=4", "--set", "batch=4", "--set", "accum=2",
        "--set", "val_windows=8", "--set", "maxent.steps=2", "--set", "maxent.batch=4", "--set", "elicit.rounds=2",
        "--set", "elicit.attack_windows=2", "--set", "titration.weights=0,1"]
EVAL_METRICS = {"val_loss", "cr", "core_cr", "retain_cr", "forget_cr", "elicited_cr", "elicited_loss",
                "elicit_gain_cr", "titration_cr", "wall_s"}
TRAIN_METRICS = {"val_loss", "train_loss", "wall_s", "routing_freq", "train_flops_ratio", "serve_params_ratio",
                 "compute_lambda", "fit_alpha", "fit_a", "fit_s0", "fit_rmse", "maxent_lambda"}
SWEEP = [0.0, 1.0, 30.0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("gradient-route", tmp_path_factory.mktemp("runs"),
                             TINY + ["--set", f"variants={','.join(VARIANTS)}", "--set", "profiles=core,core+a0"])


def test_every_variant_and_metric_is_recorded(tiny_run):
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    train, evaluated = frame[frame["phase"] == "train"], frame[frame["phase"] == "eval"]
    assert set(train["metric"]) == TRAIN_METRICS and set(evaluated["metric"]) == EVAL_METRICS
    assert set(evaluated["variant"]) == set(VARIANTS)
    assert set(evaluated["profile"]) == {"core", "core+a0", "all", "mean"}
    base = evaluated[(evaluated["variant"] == "baseline") & (evaluated["metric"] == "cr") & (evaluated["split"] == "val")]
    assert base["value"].to_numpy() == pytest.approx(1.0, abs=1e-12)  # one seed: CR(baseline) = L⁻¹(ℓ)/L⁻¹(ℓ)
    roles = evaluated[(evaluated["metric"] == "cr") & (evaluated["profile"] == "core+a0")]
    assert set(roles.loc[roles["dataset"] == "a0", "role"]) == {"retain"}
    assert set(roles.loc[roles["dataset"] == "a1", "role"]) == {"forget"}
    ratios = train[train["metric"] == "train_flops_ratio"].set_index("variant")["value"]
    assert ratios["baseline"] == 1.0 and ratios["gram"] == pytest.approx(1.0, abs=0.05)
    # one dense model per profile, on D₁ ∪ R: 8 steps × 4 windows → 26 core + 2 per aux domain (rounded shares)
    assert ratios["filter"] == pytest.approx((26 + 26 + 2) / (26 + 4 * 2), rel=1e-12)
    fits = pq.read_table(tiny_run / "fits.parquet").to_pandas()
    assert {"run_id", "dataset", "split", "a", "alpha", "s0", "rmse", "n_points"} <= set(fits.columns)
    elicit = pq.read_table(tiny_run / "elicit.parquet").to_pandas()
    assert set(elicit.columns) >= {"run_id", "variant", "profile", "dataset", "round", "split", "loss"}
    assert "baseline" not in set(elicit["variant"]) and set(elicit["round"]) == {0, 1, 2}
    assert set(elicit["lr_divisor"]) == {4.0, 64.0}  # the spec's lr/4 and the attacker's smaller lr
    best = evaluated[evaluated["metric"] == "elicited_loss"]
    row = best.iloc[0]
    curve = elicit[(elicit["variant"] == row["variant"]) & (elicit["profile"] == row["profile"])
                   & (elicit["dataset"] == row["dataset"]) & (elicit["round"] >= 1)]
    assert row["value"] == curve["loss"].min()  # the minimum over lrs and rounds, not the last


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    return train_eval_report("gradient-route", tmp_path_factory.mktemp("runs"),
                             TINY + ["--set", "variants=baseline,filter,maxent", "--set", "profiles=core,core+a0",
                                     "--set", f"maxent.lambda={','.join(map(str, SWEEP))}"])


def test_maxent_lambda_sweep_keeps_the_lambda_closest_to_the_filtered_model(sweep_run):
    from icml.cli.lifecycle import config_from_run
    from icml.cli.runstore import Run
    from icml.methods.gradient_route import METHOD
    from icml.methods.gradient_route import training as T
    from icml.methods.gradient_route.pipeline import (checkpoint_path, corpus_for, filter_distance, load_model,
                                                      read_fits, select_crs)

    cfg, _, seed = config_from_run(METHOD, Run(sweep_run))
    corpus = corpus_for(cfg, seed)
    folder = sweep_run / "checkpoints"
    frame = pq.read_table(sweep_run / "metrics.parquet").to_pandas()
    train = frame[frame["phase"] == "train"]
    fits = read_fits(Run(sweep_run))  # the end-of-train fits: the sweep must have used the same ones
    for profile, keep in (("core", []), ("core+a0", ["a0"])):
        rows = train[train["profile"] == profile]
        reference = select_crs(load_model(checkpoint_path(folder, "filter", profile, seed), cfg, corpus), corpus, fits)
        recorded_reference = rows[(rows["variant"] == "filter") & (rows["metric"] == "maxent_select_cr")]
        assert dict(zip(recorded_reference["dataset"], recorded_reference["value"])) == pytest.approx(reference, abs=1e-12)
        scores = rows[rows["metric"] == "maxent_select_score"].set_index("weight")["value"]
        assert sorted(scores.index) == SWEEP
        for lam in SWEEP:  # each score is the rule applied to that λ's recorded held-apart CRs
            crs = rows[(rows["metric"] == "maxent_select_cr") & (rows["weight"] == lam)]
            crs = dict(zip(crs["dataset"], crs["value"]))
            assert set(crs) == {"core", "a0", "a1", "a2", "a3"}
            assert scores[lam] == pytest.approx(filter_distance(crs, reference, keep, corpus.aux), abs=1e-12)
        (chosen,) = rows.loc[rows["metric"] == "maxent_lambda", "value"]
        assert chosen == scores.idxmin()
        # the deployed MaxEnt is that λ's model: the baseline unlearned again at the chosen λ
        model = load_model(checkpoint_path(folder, "baseline", None, seed), cfg, corpus)
        base = T.baseline_counts(cfg, corpus)
        forget = torch.cat([corpus.train(d, base[d]) for d in corpus.aux if d not in keep])
        T.maxent_unlearn(model, forget, corpus.train("core", base["core"]),
                         corpus.train("a0", base["a0"]) if keep else None, cfg, corpus.pad_id, seed, chosen)
        saved = load_model(checkpoint_path(folder, "maxent", profile, seed), cfg, corpus).state_dict()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=0)
    # every λ's MaxEnt was trained, so the sweep's cost is len(SWEEP) unlearning runs per profile
    costs = train[train["metric"] == "train_flops_ratio"].set_index("variant")["value"]
    baseline = next(info for v, _, _, info in json.loads((folder / "train_info.json").read_text()) if v == "baseline")
    tokens = len(SWEEP) * 2 * cfg.maxent.steps * cfg.maxent.batch * (corpus.length - 1)  # forget + retain, per λ
    assert costs["maxent"] == pytest.approx(1 + 2 * tokens * baseline["dense_params"] / baseline["flops"], rel=1e-12)
    html = (sweep_run.parent.parent / "r.html").read_text()
    assert "MaxEnt λ sweep on held-apart windows" in html


def test_ft_lora_is_the_core_only_base_plus_one_low_rank_update_per_retained_domain(tiny_run):
    from icml.cli.lifecycle import config_from_run
    from icml.cli.runstore import Run
    from icml.methods.gradient_route import METHOD
    from icml.methods.gradient_route.pipeline import corpus_for, deployed_model

    cfg, _, seed = config_from_run(METHOD, Run(tiny_run))
    corpus = corpus_for(cfg, seed)
    folder = tiny_run / "checkpoints"
    core = deployed_model(cfg, corpus, folder, "ft_lora", "core", seed, "cpu").state_dict()
    with_a0 = deployed_model(cfg, corpus, folder, "ft_lora", "core+a0", seed, "cpu").state_dict()
    changed = {k for k in core if not torch.equal(core[k], with_a0[k])}
    # only the core MLPs' c_fc / c_proj weights move (biases, attention, embeddings are the base's)
    assert changed == {f"transformer.h.{i}.mlp.core.{m}.weight" for i in range(1) for m in ("c_fc", "c_proj")}
    frame = pq.read_table(tiny_run / "metrics.parquet").to_pandas()
    costs = frame[frame["metric"].isin(["train_flops_ratio", "serve_params_ratio"])]
    costs = costs[costs["variant"] == "ft_lora"].set_index("metric")["value"]
    lora_share = costs["serve_params_ratio"] - 1  # (base + LoRA parameters) / baseline parameters
    # the base sees the 26 core windows, a0's LoRA 2 · 2 core + 2 a0 windows through base + LoRA; baseline 34
    assert costs["train_flops_ratio"] == pytest.approx((26 + 6 * (1 + lora_share)) / 34, rel=1e-12)


def test_report_renders_tables_and_plots(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    for title in ("Compute ratios per variant", "Compute ratios per profile", "CR per profile × dataset",
                  "Raw val_loss per profile", "Titration of module a0", "Costs", "Power-law fits"):
        assert title in html
    assert html.count("data:image/png;base64,") == 5


def test_export_is_a_plain_gpt2_with_the_profile_function(icml, tiny_run, tmp_path):
    from transformers import GPT2LMHeadModel

    from icml.cli.lifecycle import config_from_run
    from icml.cli.runstore import Run
    from icml.methods.gradient_route import METHOD
    from icml.methods.gradient_route.model import forward
    from icml.methods.gradient_route.pipeline import corpus_for, deployed_model

    out = tmp_path / "core+a0"
    result = icml("gradient-route", "export", tiny_run, "--profile", "core+a0", "--out", out, "--json")
    assert result.code == 0, result.err
    assert result.json()["mlp_width"] == 24 + 8
    exported = GPT2LMHeadModel.from_pretrained(out, local_files_only=True)
    cfg, _, seed = config_from_run(METHOD, Run(tiny_run))
    corpus = corpus_for(cfg, seed)
    served = deployed_model(cfg, corpus, tiny_run / "checkpoints", "gram", "core+a0", seed, "cpu")
    x = corpus.val["a0"][:, :-1]
    with torch.no_grad():
        expected = forward(served, x)
        got = exported(input_ids=x).logits
    # float32, one concatenated matmul instead of two summed ones
    torch.testing.assert_close(got, expected, rtol=0, atol=64 * torch.finfo(torch.float32).eps * float(expected.abs().max()))
    assert json.loads((out / "alphabet.json").read_text())["chars"].startswith("\x00abc")
    bad = icml("gradient-route", "export", tiny_run, "--profile", "core+zz", "--out", tmp_path / "x")
    assert bad.code == 2 and "is not core, core+<module>" in bad.err


def test_user_folder_and_local_gpt2(icml, tmp_path):
    from transformers import GPT2LMHeadModel

    from icml.methods.gradient_route.model import gpt2_config

    root = tmp_path / "domains"
    for name, line in (("core", "plain words for every reader. "), ("bio", "cells divide and grow. "),
                       ("chem", "acids and bases react. "), ("unlabelled", "mixed text of all kinds. ")):
        (root / name).mkdir(parents=True)
        for i in range(6):
            (root / name / f"{i}.txt").write_text(f"{line}{i} " * 40)
    result = icml("gradient-route", "train", *TINY, "--data", root, "--set", "profiles=core+bio", "--json")
    assert result.code == 0, result.err
    run = result.json()["run_dir"]
    assert icml("gradient-route", "eval", run).code == 0
    frame = pq.read_table(f"{run}/metrics.parquet").to_pandas()
    assert {"bio", "chem"} <= set(frame["dataset"].dropna()) and "core+bio" in set(frame["profile"].dropna())

    from icml.cli.config import apply_overrides
    from icml.methods.gradient_route.config import preset

    from test_gradient_route_checkpoint import _bpe_tokenizer

    cfg = apply_overrides(preset("smoke"), [a for a in TINY[3::2]])
    model_dir = tmp_path / "gpt2"
    tokenizer = _bpe_tokenizer()
    GPT2LMHeadModel(gpt2_config(cfg, len(tokenizer), 48)).save_pretrained(model_dir)
    # without its tokenizer the run would feed character ids into the checkpoint's embedding: refused up front
    runs = sorted((tmp_path / "runs" / "gradient-route").iterdir())
    result = icml("gradient-route", "train", *TINY, "--model", model_dir, "--set", "profiles=core")
    assert result.code == 2 and "has no tokenizer" in result.err
    assert sorted((tmp_path / "runs" / "gradient-route").iterdir()) == runs  # no run was created
    tokenizer.save_pretrained(model_dir)
    result = icml("gradient-route", "train", *TINY, "--model", model_dir, "--set", "variants=baseline,gram",
                  "--set", "profiles=core", "--json")
    assert result.code == 0, result.err


@pytest.mark.parametrize("argv, message", [
    (["--set", "variants=baseline,gramm"], "unknown variant(s) ['gramm']"),
    (["--set", "variants=gram"], "variants must include baseline"),
    (["--set", "profiles=core+a9"], "unknown module(s) ['a9']"),
    (["--set", "batch=6", "--set", "accum=4"], "must be a multiple of accum"),
    (["--set", "p_as=1.5"], "p_as must be in [0, 1]"),
    (["--set", "routing=soft"], "routing must be one of"),
    (["--set", "lora_rank=0"], "lora_rank must be positive"),
    (["--set", "elicit.extra_lr_divisors=64,0"], "elicit.extra_lr_divisors and clip must be positive"),
    (["--set", "steps=10", "--set", "cr.eval_every=8"], "at least 2 baseline evaluations"),
    (["--set", "maxent.lambda=1,-1"], "maxent.lambda must be one or more weights >= 0"),
    (["--set", "maxent.lambda=1,3", "--set", "variants=baseline,maxent"], "add filter to variants"),
])
def test_bad_config_is_one_line(icml, argv, message):
    result = icml("gradient-route", "train", "--preset", "smoke", *argv)
    assert result.code == 2 and message in result.err and "Traceback" not in result.err


def test_bad_data_folder_is_one_line(icml, tmp_path):
    tmp_path = tmp_path / "data"  # the fixture's runs/ lives in tmp_path
    tmp_path.mkdir()
    result = icml("gradient-route", "train", "--preset", "smoke", "--data", tmp_path)
    assert result.code == 2 and "has no 'core' subfolder" in result.err
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.txt").write_text("x" * 50)
    result = icml("gradient-route", "train", *TINY, "--data", tmp_path)
    lines = [line for line in result.err.splitlines() if line.startswith("icml: error:")]
    assert result.code == 2 and len(lines) == 1 and "no auxiliary domain folder" in lines[0]
