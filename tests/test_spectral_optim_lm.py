"""The language-model benchmark of `icml spectral-optim`: corpora, tokenizer, batch order, shared
initial weights, the training loop and the grid summary's closed forms."""
from __future__ import annotations

import math
import random
import re
from dataclasses import replace

import pandas as pd
import pytest
import torch

from icml.cli.errors import UsageError
from icml.methods.spectral_optim.config import ModelConfig, SpectralOptimConfig
from icml.methods.spectral_optim.data import (ARITHMETIC_FRACTION, UNKNOWN_TOKEN, build_char_tokenizer, encode,
                                              generated_corpus, load_tokenizer, make_batches, prepare_data,
                                              read_text_file, split_train_val, stdlib_corpus, stdlib_sources)
from icml.methods.spectral_optim.lm import (RunSettings, final_val_loss, grid_summary, prepare_grid,
                                            set_learning_rates, train_one)
from icml.methods.spectral_optim.model import load_causal_lm, next_token_loss, tiny_gpt2
from icml.methods.spectral_optim.optim import PAPER_VARIANTS, SpectralOptimizer

ARITHMETIC = re.compile(r"^(\d+) \+ (\d+) = (\d+)$")


def small_config(**changes) -> SpectralOptimConfig:
    """A grid small enough for a unit test: a 2-layer, 32-wide GPT on 30k characters."""
    cfg = SpectralOptimConfig(steps=20, batch_size=8, block_size=32, corpus_chars=30_000, val_every=10,
                              train_log_every=5, val_batches=2, gpt=ModelConfig(n_embd=32, n_layer=2, n_head=2,
                                                                                n_positions=32))
    return replace(cfg, **changes)



@pytest.fixture(scope="module")
def grid():
    return prepare_grid(small_config(), seed=0)


# --------------------------------------------------------------------------------------------
# Corpora
# --------------------------------------------------------------------------------------------
def test_generated_corpus_is_deterministic_per_seed_and_exact_in_length():
    text = generated_corpus(seed=3, n_chars=50_000)
    assert len(text) == 50_000
    assert generated_corpus(seed=3, n_chars=50_000) == text
    assert generated_corpus(seed=4, n_chars=50_000) != text
    assert generated_corpus(seed=3, n_chars=20_000) == text[:20_000]  # a longer corpus extends a shorter


def test_generated_corpus_has_a_fifth_correct_arithmetic_lines_and_toy_english():
    lines = generated_corpus(seed=0, n_chars=200_000).split("\n")[:-1]  # the last line may be cut
    sums = [ARITHMETIC.match(line) for line in lines]
    arithmetic = [m for m in sums if m]
    # ~5000 lines: the binomial standard deviation of the fraction is ~0.006, so ±0.03 is ~5σ
    assert abs(len(arithmetic) / len(lines) - ARITHMETIC_FRACTION) < 0.03
    assert all(int(m[1]) + int(m[2]) == int(m[3]) for m in arithmetic)
    sentences = [line for line, m in zip(lines, sums) if not m]
    assert all(line[0].isupper() and line.endswith(".") for line in sentences)
    words = {word for line in sentences for word in re.findall(r"[a-z]+", line.lower())}
    assert 250 <= len(words) <= 330  # the spec's ~300-word lexicon


def test_subject_verb_agreement_in_simple_sentences():
    """'<Det> (<adj>) <noun> <verb>.' must agree: plural nouns take the plural verb form."""
    from icml.methods.spectral_optim.data import ANIMATE_NOUNS, INTRANSITIVE_VERBS

    singular_nouns = {s for s, _ in ANIMATE_NOUNS}
    plural_nouns = {p for _, p in ANIMATE_NOUNS}
    singular_verbs = {s for s, _ in INTRANSITIVE_VERBS}
    plural_verbs = {p for _, p in INTRANSITIVE_VERBS}
    checked = 0
    for line in generated_corpus(seed=1, n_chars=200_000).split("\n")[:-1]:
        words = line.rstrip(".").lower().split()
        if len(words) in (3, 4) and words[-1] in singular_verbs | plural_verbs and words[-2] in singular_nouns | plural_nouns:
            checked += 1
            assert (words[-2] in plural_nouns) == (words[-1] in plural_verbs), line
    assert checked > 50


def test_stdlib_corpus_is_sorted_sources_without_tests():
    paths = stdlib_sources()
    assert paths == sorted(paths) and paths
    assert not any({"test", "tests", "site-packages"} & set(p.parts) for p in paths[:2000])
    text = stdlib_corpus(100_000)
    assert len(text) == 100_000
    assert text.startswith(paths[0].read_text(encoding="utf-8")[:1000])


def test_bad_data_files_fail_in_one_line(tmp_path):
    empty, latin1, short = tmp_path / "empty.txt", tmp_path / "latin1.txt", tmp_path / "short.txt"
    empty.write_text("  \n")
    latin1.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    short.write_text("hello world\n" * 20)  # 240 chars: a 24-char val split < block_size+2
    for path, problem in [(empty, "empty"), (latin1, "not UTF-8"), (tmp_path / "missing.txt", "cannot read")]:
        with pytest.raises(ValueError, match=problem) as error:
            read_text_file(path)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="block_size") as error:
        prepare_data(small_config(corpus="file", data=str(short)), seed=0)
    assert "\n" not in str(error.value)


def test_user_file_corpus_is_used_whole(tmp_path):
    path = tmp_path / "corpus.txt"
    text = "the quick brown fox jumps over the lazy dog\n" * 200
    path.write_text(text)
    data = prepare_data(small_config(corpus="file", data=str(path)), seed=0)
    assert len(data.train_ids) + len(data.val_ids) == len(text)
    assert data.tokenizer.decode(torch.cat([data.train_ids, data.val_ids]).tolist()) == text


# --------------------------------------------------------------------------------------------
# Tokenizer and batches
# --------------------------------------------------------------------------------------------
def test_char_tokenizer_round_trips_exactly_and_through_save_pretrained(tmp_path):
    text = "Two cats sleep.\n12 + 7 = 19\n\ttabs, é, 漢 and a literal <unk> stay as they are.\n\n"
    tokenizer = build_char_tokenizer(text)
    assert len(tokenizer) == len(set(text)) + 1  # one id per character, plus <unk>
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer("Z", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(UNKNOWN_TOKEN)]
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
    assert reloaded.decode(ids) == text
    assert torch.equal(encode(reloaded, text * 3000), encode(tokenizer, text * 3000))  # chunked encoding


def test_batches_depend_on_the_seed_only():
    ids = torch.arange(10_000)
    train, val = split_train_val(ids, block_size=16, source="test")
    assert torch.equal(torch.cat([train, val]), ids) and len(val) == 1_000  # contiguous 90/10
    first, second = make_batches(train, val, 4, 16, seed=7), make_batches(train, val, 4, 16, seed=7)
    later_first = [second.train[5], second.val[2], second.train[0]]  # a different access order
    assert torch.equal(first.train[0], later_first[2]) and torch.equal(first.train[5], later_first[0])
    assert torch.equal(first.val[2], later_first[1])
    assert not torch.equal(make_batches(train, val, 4, 16, seed=8).train[0], first.train[0])
    window = first.train[3]
    assert window.shape == (4, 17)
    assert torch.equal(window[:, 1:] - window[:, :-1], torch.ones(4, 16, dtype=torch.long))  # consecutive tokens
    assert int(first.val[0].min()) >= 9_000  # val windows never leave the val split


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def test_every_run_starts_from_the_same_weights(grid):
    rebuilt = prepare_grid(small_config(), seed=0)
    for (name, a), (_, b) in zip(grid.model_init.state_dict().items(), rebuilt.model_init.state_dict().items()):
        assert torch.equal(a, b), name
    before = {k: v.clone() for k, v in grid.model_init.state_dict().items()}
    cfg = small_config(steps=2, val_every=2)
    initial_losses = set()
    for variant in ("Adam", "mSGDZ"):
        rows, _ = train_one(cfg, variant, 1.0, grid.model_init, grid.batches, "cpu")
        initial_losses |= {r["value"] for r in rows if r["metric"] == "val_loss" and r["step"] == 0}
    assert len(initial_losses) == 1  # same weights and same val batches: bit-identical step-0 loss
    assert all(torch.equal(before[k], v) for k, v in grid.model_init.state_dict().items())  # untouched
    assert not torch.equal(tiny_gpt2(32, 2, 2, 32, 50, init_seed=1).transformer.wte.weight,
                           tiny_gpt2(32, 2, 2, 32, 50, init_seed=2).transformer.wte.weight)


def test_initial_loss_is_ln_vocab(grid):
    """GPT-2's init (std 0.02, tied head) gives logits of std ≈ 0.02·√n_embd after ln_f, and a
    cross-entropy of ln V + Var(logit)/2 to second order: ≈ ln V + 0.004 at n_embd 32 (≈ +0.03 at
    the default 128). It cannot fall below ln V on average (logsumexp ≥ mean + ln V), so
    [−0.02, +0.1] leaves room only for batch noise."""
    loss = final_val_loss(grid.model_init, grid.batches, 4)
    assert -0.02 < loss - math.log(grid.vocab_size) < 0.1


def test_a_saved_checkpoint_loads_as_a_fine_tune_grid(tmp_path):
    cfg = small_config()
    text = generated_corpus(0, cfg.corpus_chars)
    tokenizer = build_char_tokenizer(text)
    model = tiny_gpt2(32, 2, 2, 32, len(tokenizer), init_seed=5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_causal_lm(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded_tokenizer("12 + 7", add_special_tokens=False)["input_ids"] == \
        tokenizer("12 + 7", add_special_tokens=False)["input_ids"]
    grid = prepare_grid(replace(cfg, model=str(tmp_path)), seed=0)
    assert grid.vocab_size == len(tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), grid.model_init.state_dict().values()))
    with pytest.raises(ValueError, match="context length"):
        prepare_grid(replace(cfg, model=str(tmp_path), block_size=64), seed=0)


def test_bad_checkpoint_directories_fail_in_one_line(tmp_path):
    (tmp_path / "weights_only").mkdir()
    tiny_gpt2(32, 2, 2, 32, 50, init_seed=0).save_pretrained(tmp_path / "weights_only")  # no tokenizer
    (tmp_path / "empty").mkdir()
    for path, problem in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "no config.json"),
                          (tmp_path / "weights_only", "has no tokenizer")]:
        with pytest.raises(UsageError, match=problem) as error:  # one line naming the fix, as check_inputs gives it
            load_causal_lm(path)
        assert "\n" not in error.value.line() and error.value.fix


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def test_learning_rates_follow_the_variant_table_and_the_schedule(grid):
    cfg = small_config(steps=100, warmup_frac=0.1, min_lr_frac=0.01, lr_vector=3e-3)
    settings = RunSettings.of(cfg, "mSGDS", 3.0)
    assert settings.lr_matrix == pytest.approx(3.0 * PAPER_VARIANTS["mSGDS"].lr_matrix)
    assert settings.lr_vector == 3e-3 and settings.warmup_steps == 10
    optimizer = SpectralOptimizer(grid.model_init, "mSGDS", settings.lr_matrix, settings.lr_vector)
    lrs = {}
    for step in (0, 10, 99):
        set_learning_rates(optimizer, settings, step, cfg.steps)
        lrs[step] = {g["kind"]: g["lr"] for g in optimizer.param_groups}
    assert lrs[0]["matrix"] == pytest.approx(0.6 / 11) and lrs[0]["vector"] == pytest.approx(3e-3 / 11)
    assert lrs[10]["matrix"] == pytest.approx(0.6) and lrs[10]["vector"] == pytest.approx(3e-3)
    cosine_end = 0.006 + 0.5 * (1 + math.cos(math.pi * 89 / 90)) * (0.6 - 0.006)
    assert lrs[99]["matrix"] == pytest.approx(cosine_end)
    paper = RunSettings.of(small_config(lr_vector=None, min_lr_frac=None), "AdamQ", 1.0)
    assert (paper.lr_vector, paper.min_lr_matrix, paper.min_lr_vector) == (6e-4, 3e-6, 3e-6)


def test_a_short_adam_run_lowers_the_val_loss_and_logs_on_schedule(grid):
    cfg = small_config()
    advanced = []
    rows, state = train_one(cfg, "Adam", 1.0, grid.model_init, grid.batches, "cpu", progress=advanced.append)
    val = {r["step"]: r["value"] for r in rows if r["metric"] == "val_loss"}
    assert sorted(val) == [0, 10, 20]
    assert val[20] < val[0] - 0.3, val
    assert sorted(r["step"] for r in rows if r["metric"] == "train_loss") == [0, 5, 10, 15, 19]
    assert sum(advanced) == cfg.steps
    assert not state["diverged"] and state["steps_done"] == 20 and state["final_val_loss"] == val[20]
    assert state["step_ms"] > 0
    n_params = sum(p.numel() for p in grid.model_init.parameters())  # tied weights counted once
    assert state["optimizer_state_bytes"] == 2 * 4 * n_params  # Adam: two fp32 moments per parameter
    tags = {(r["variant"], r["family"], r["p"], r["lr"], r["lr_multiplier"], r["lr_vector"]) for r in rows}
    assert tags == {("Adam", "adam", 1.0, PAPER_VARIANTS["Adam"].lr_matrix, 1.0, cfg.lr_vector)}
    model = tiny_gpt2(32, 2, 2, 32, grid.vocab_size, init_seed=0)
    model.load_state_dict(state["model_state"])
    assert final_val_loss(model, grid.batches, cfg.val_batches) == pytest.approx(val[20], abs=1e-5)


def test_a_blown_up_run_is_marked_diverged(grid):
    cfg = small_config(steps=10, val_every=5)
    rows, state = train_one(cfg, "mSGD", 1e4, grid.model_init, grid.batches, "cpu")
    assert state["diverged"]
    assert [r["value"] for r in rows if r["metric"] == "diverged"] == [1.0]


# --------------------------------------------------------------------------------------------
# Grid summary
# --------------------------------------------------------------------------------------------
def hand_made_grid() -> pd.DataFrame:
    """Final val losses per (variant, multiplier); initial val loss 4.0 everywhere."""
    finals = {
        "Adam": {0.1: 2.5, 1.0: 2.0, 3.0: 2.2},
        "AdamS": {0.1: 2.6, 1.0: 2.1, 3.0: 2.05},
        "mSGD": {0.1: 3.0, 1.0: 2.8, 3.0: float("nan")},  # blew up: non-finite
        "mSGDZ": {0.1: 2.4, 1.0: 2.3, 3.0: 4.5},  # ended above its initial loss: diverged
    }
    rows = []
    for variant, grid in finals.items():
        spec = PAPER_VARIANTS[variant]
        for multiplier, final in grid.items():
            tags = {"variant": variant, "family": spec.family, "p": spec.p, "lr": spec.lr_matrix * multiplier,
                    "lr_multiplier": multiplier, "lr_vector": 3e-3, "phase": "train"}
            rows += [{**tags, "metric": "val_loss", "step": 0, "value": 4.0},
                     {**tags, "metric": "val_loss", "step": 250, "value": final},
                     {**tags, "metric": "train_loss", "step": 0, "value": 4.1}]
    # eval phase re-measures Adam×0.1 on more batches: the summary must use it, not the training value
    spec = PAPER_VARIANTS["Adam"]
    rows.append({"variant": "Adam", "family": "adam", "p": 1.0, "lr": spec.lr_matrix * 0.1, "lr_multiplier": 0.1,
                 "lr_vector": 3e-3, "phase": "eval", "metric": "val_loss", "step": 250, "value": 1.9})
    return pd.DataFrame(rows)


def test_grid_summary_closed_forms():
    ln_v = math.log(50)
    summary = {(r["variant"], r["metric"]): r for r in grid_summary(hand_made_grid(), vocab_size=50)}
    value = {key: r["value"] for key, r in summary.items()}
    assert value["Adam", "best_val_loss"] == 1.9 and summary["Adam", "best_val_loss"]["lr_multiplier"] == 0.1
    assert summary["Adam", "best_val_loss"]["lr"] == pytest.approx(4e-4)
    assert value["Adam", "lr_spread"] == pytest.approx(2.2 - 1.9) and value["Adam", "diverged"] == 0
    assert value["AdamS", "best_val_loss"] == 2.05 and value["AdamS", "lr_spread"] == pytest.approx(2.6 - 2.05)
    assert value["mSGD", "best_val_loss"] == 2.8 and value["mSGD", "diverged"] == 1
    assert value["mSGD", "lr_spread"] == pytest.approx(ln_v - 2.8)  # the NaN run counts as ln V
    assert value["mSGDZ", "best_val_loss"] == 2.3 and value["mSGDZ", "diverged"] == 1
    assert value["mSGDZ", "lr_spread"] == pytest.approx(ln_v - 2.3)  # 4.5 > initial 4.0: counts as ln V
    assert value["adam", "family_best_spread"] == pytest.approx(2.05 - 1.9)
    assert value["msgd", "family_best_spread"] == pytest.approx(2.8 - 2.3)
    assert len(summary) == 4 * 3 + 2


def test_grid_summary_breaks_ties_by_lr_not_by_row_order():
    """With workers > 1 runs are recorded in completion order; a tie (here every mSGD run
    diverged, all at ln V) must still pick the same run: the smallest LR."""
    frame = hand_made_grid()
    frame.loc[frame["variant"] == "mSGD", "value"] = float("nan")
    for order in (frame, frame.iloc[::-1]):
        best = {r["variant"]: r for r in grid_summary(order, vocab_size=50) if r["metric"] == "best_val_loss"}
        assert best["mSGD"]["lr_multiplier"] == 0.1 and best["mSGD"]["value"] == pytest.approx(math.log(50))
        assert best["Adam"]["lr_multiplier"] == 0.1 and best["AdamS"]["lr_multiplier"] == 3.0


def test_grid_summary_reads_train_one_rows(grid):
    cfg = small_config(steps=4, val_every=2)
    rows = []
    for multiplier in (0.5, 1.0):
        rows += train_one(cfg, "AdamS", multiplier, grid.model_init, grid.batches, "cpu")[0]
    summary = {r["metric"]: r for r in grid_summary(rows, vocab_size=grid.vocab_size)}
    finals = {r["lr_multiplier"]: r["value"] for r in rows if r["metric"] == "val_loss" and r["step"] == 4}
    assert summary["best_val_loss"]["value"] == min(finals.values())
    assert summary["lr_spread"]["value"] == pytest.approx(abs(finals[0.5] - finals[1.0]))
    assert "family_best_spread" not in summary  # one variant per family: no spread to report
