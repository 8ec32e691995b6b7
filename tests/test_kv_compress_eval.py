"""kv-compress evaluation identities on a random tiny Llama: at r=1 every variant is the full
cache, entrokv_alpha0 reproduces snapkv exactly, kept entries are equal across variants at a
fixed ratio, and the global total is conserved per example."""
from __future__ import annotations

import random

import pandas as pd
import pytest
import torch

from icml.methods.kv_compress.config import VARIANTS, preset
from icml.methods.kv_compress.data import build_tokenizer, generate
from icml.methods.kv_compress.evaluation import evaluate_example, token_f1, variant_spec
from icml.methods.kv_compress.model import tiny_model


@pytest.fixture(scope="module")
def results():
    cfg = preset("smoke")
    cfg.tiny.hidden, cfg.tiny.intermediate = 32, 64
    cfg.tiny.init_std = 0.02  # HF's default scale: ×20 below gives heads of differing entropy
    tokenizer = build_tokenizer()
    model = tiny_model(cfg, len(tokenizer), 0).eval()
    with torch.no_grad():  # sharper attention than at init, so that heads' entropies differ
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
    specs = [variant_spec(v, cfg) for v in VARIANTS]
    rng = random.Random(1)
    rows, alloc = [], []
    for i, task in enumerate(["kv_retrieval", "needle", "aggregation"]):
        r, a = evaluate_example(model, tokenizer, generate(task, i, rng, 70, 90), cfg, specs, [0.3, 1.0],
                                0.3, "cpu")
        rows += r
        alloc += a
    return pd.DataFrame(rows), pd.DataFrame(alloc), cfg


def test_full_budget_equals_full_cache(results):
    rows, _, _ = results
    full = rows[rows["variant"] == "full"].set_index(["task", "ratio"])
    at_one = rows[rows["ratio"] == 1.0]
    for _, row in at_one.iterrows():
        reference = full.loc[(row["task"], 1.0)]
        assert row["exact_match"] == reference["exact_match"]
        assert row["answer_nll"] == pytest.approx(reference["answer_nll"], abs=1e-5)
        assert abs(row["kl_to_full"]) < 1e-6


def test_alpha0_reproduces_snapkv_exactly(results):
    rows, alloc, _ = results
    metrics = ["exact_match", "answer_nll", "kl_to_full", "kept_entries", "memory_bytes"]
    a = rows[rows["variant"] == "entrokv_alpha0"].set_index(["task", "ratio"])[metrics]
    b = rows[rows["variant"] == "snapkv"].set_index(["task", "ratio"])[metrics]
    pd.testing.assert_frame_equal(a, b)
    budgets = lambda v: alloc[alloc["variant"] == v]["budget"].to_numpy()  # noqa: E731
    assert (budgets("entrokv_alpha0") == budgets("snapkv")).all()


def test_kept_entries_equal_across_variants_and_totals_conserved(results):
    rows, alloc, cfg = results
    compressed = rows[(rows["ratio"] == 0.3) & ~rows["variant"].isin(["full", "entrokv_qagnostic"])]
    assert compressed.groupby("task")["kept_entries"].nunique().eq(1).all()
    full = rows[(rows["variant"] == "full")]
    assert (compressed.groupby("task")["memory_bytes"].max() < full.groupby("task")["memory_bytes"].max()).all()
    entro = alloc[(alloc["variant"] == "entrokv_snapkv") & (alloc["ratio"] == 0.3)]
    assert entro.groupby("task")["budget"].nunique().gt(1).all()  # entropy makes budgets differ…
    totals = alloc[alloc["ratio"] == 0.3].groupby(["task", "variant"])["budget"].sum().unstack()
    assert totals.drop(columns=["full", "entrokv_qagnostic"]).nunique(axis=1).eq(1).all()  # …not totals
    assert (alloc["kept"] == alloc["budget"] + cfg.window).all()


def test_token_f1_takes_the_best_reference_answer():
    """LongBench scores a free answer against every reference and keeps the best; the metric is
    named token_f1, not exact_match. The prediction here is the model's own greedy answer."""
    from dataclasses import replace

    from icml.methods.kv_compress.evaluation import greedy_answer, split
    from icml.methods.kv_compress.model import RaggedCache, prefill

    cfg = preset("smoke")
    cfg.tiny.hidden, cfg.tiny.intermediate = 32, 64
    cfg.scoring, cfg.max_new_tokens = "f1", 3
    tokenizer = build_tokenizer()
    model = tiny_model(cfg, len(tokenizer), 0).eval()
    example = generate("kv_retrieval", 0, random.Random(2), 70, 90)
    parts = split(tokenizer, example, True, "cpu")
    state = prefill(model, parts.prefix, cfg.window)
    full = RaggedCache.from_prefill(state, [[torch.arange(state.n)] * state.shape[1]] * state.shape[0])
    predicted = greedy_answer(model, tokenizer, full, parts, cfg.max_new_tokens)
    specs = [variant_spec("full", cfg)]
    scores = {}
    assert predicted.strip(".").strip()  # a non-empty answer, so the normalised reference below is too
    for name, answers in (("wrong only", ("zz-nothing",)), ("wrong then right", ("zz-nothing", predicted)),
                          ("wrong then right up to case and a full stop", ("zz-nothing", f"The {predicted.upper()}."))):
        rows, _ = evaluate_example(model, tokenizer, replace(example, answers=answers), cfg, specs, [1.0], 0.3, "cpu")
        assert "exact_match" not in rows[0]
        scores[name] = rows[0]["token_f1"]
    assert scores == {"wrong only": 0.0, "wrong then right": 1.0, "wrong then right up to case and a full stop": 1.0}


@pytest.mark.parametrize("predicted, gold, f1", [
    ("66226.", "66226", 1.0),  # the case: a trailing full stop no longer scores 0
    ("The Eiffel Tower!", "eiffel  tower", 1.0),  # case, an article, punctuation and spacing removed
    ("Paris, France", "the city of Paris", 2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3)),  # P 1/2, R 1/3
    ("x y y", "y y z y", 2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4)),  # multiset overlap: y counts twice
    ("don't", "dont", 1.0),  # an apostrophe is punctuation: removed inside the word
    ("an apple", "apple", 1.0),
    ("the", "a", 0.0),  # both normalise to nothing: LongBench scores 0, not a match
    ("", "", 0.0),
])
def test_token_f1_is_longbench_qa_f1_score(predicted, gold, f1):
    assert token_f1(predicted, gold) == pytest.approx(f1, abs=1e-15)
