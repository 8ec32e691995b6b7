"""kv-compress training data: every supervised token of the dense sequences is the answer its
prefix determines (checked by an independent replay), the curriculum and batches are deterministic
from (seed, step), and the recipe's config keys are validated."""
from __future__ import annotations

import random

import pytest

from icml.methods.kv_compress.config import KvCompressConfig, validate
from icml.methods.kv_compress.data import CUE, KEYS, VALUES, build_tokenizer, copy_sequence, recall_sequence
from icml.methods.kv_compress.training import context_range, training_batch


def _replay(words: list[str]) -> list[bool]:
    """Which words a reader who only knows the format can predict, asserting each prediction: a value
    after a key already paired, the value of `? k =`, and the count digit of `count v ? =`."""
    pairs: dict[str, str] = {}
    predicted = []
    for i, word in enumerate(words):
        before = words[max(0, i - 4):i]
        if word in VALUES and before[-1:] and before[-1] in KEYS and before[-2:-1] != ["?"]:
            key = before[-1]
            assert words[i + 1] == ";"  # a pair is `k v ;`
            if key in pairs:
                assert pairs[key] == word, "a repeated key keeps its value"
                predicted.append(True)
                continue
            pairs[key] = word
        elif len(before) >= 3 and before[-3] == "?" and before[-2] in KEYS and before[-1] == CUE:
            assert pairs[before[-2]] == word, "retrieval answer"
            predicted.append(True)
            continue
        elif len(before) == 4 and before[0] == "count" and before[2:] == ["?", CUE]:
            assert str(sum(v == before[1] for v in pairs.values()) % 10) == word, "count answer"
            predicted.append(True)
            continue
        predicted.append(False)
    return predicted


@pytest.mark.parametrize("repeats, counts", [(0.5, 0.25), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0)])
def test_recall_targets_are_exactly_the_predictable_answers(repeats, counts):
    rng = random.Random(7)
    kinds = {"repeat": 0, "count": 0, "retrieval": 0}
    for _ in range(60):
        length = rng.randint(16, 320)
        words, targets = recall_sequence(rng, length, repeats, counts)
        assert len(words) == len(targets) and length <= len(words) < length + 5
        assert targets == _replay(words) and any(targets)
        for i in (i for i, t in enumerate(targets) if t):
            kinds["count" if words[i - 4] == "count" else "retrieval" if words[i - 3] == "?" else "repeat"] += 1
    assert (kinds["repeat"] > 0) == (repeats > 0) and (kinds["count"] > 0) == (counts > 0 and repeats < 1)
    assert (kinds["retrieval"] > 0) == (repeats < 1 and counts < 1)


def test_copy_sequence_targets_the_repetition():
    words, targets = copy_sequence(random.Random(3), 41)
    assert len(words) == 40 and words[:20] == words[20:]
    assert targets == [False] * 21 + [True] * 19


def test_dense_sequences_are_deterministic():
    assert recall_sequence(random.Random(5), 200, 0.5, 0.25) == recall_sequence(random.Random(5), 200, 0.5, 0.25)
    assert recall_sequence(random.Random(5), 200, 0.5, 0.25) != recall_sequence(random.Random(6), 200, 0.5, 0.25)
    assert copy_sequence(random.Random(5), 64) == copy_sequence(random.Random(5), 64)


def test_curriculum_holds_short_then_grows_to_eval_lengths():
    cfg = KvCompressConfig(steps=1000, curriculum_hold=0.4, curriculum_grow=0.3)
    assert context_range(0, cfg) == context_range(400, cfg) == (cfg.train_context_min, cfg.train_context_short)
    assert context_range(550, cfg) == (96, 192)  # halfway: 32→160 and 64→320
    assert context_range(700, cfg) == context_range(999, cfg) == (cfg.context_min, cfg.context_max)
    jump = KvCompressConfig(steps=10, curriculum_hold=0.5, curriculum_grow=0.0)
    assert context_range(4, jump) == (32, 64) and context_range(5, jump) == (160, 320)


def test_training_batch_labels_only_targets_and_is_deterministic():
    tokenizer = build_tokenizer()
    cfg = KvCompressConfig(steps=100)
    first = training_batch(tokenizer, cfg, 0, 3)
    assert all((first[k] == training_batch(tokenizer, cfg, 0, 3)[k]).all() for k in first)
    assert first["input_ids"].shape != training_batch(tokenizer, cfg, 0, 4)["input_ids"].shape \
        or (first["input_ids"] != training_batch(tokenizer, cfg, 0, 4)["input_ids"]).any()
    ids, labels = first["input_ids"], first["labels"]
    assert ids.shape[0] == cfg.batch_size and (ids[:, 0] == tokenizer.bos_token_id).all()
    supervised = labels != -100
    assert (labels[supervised] == ids[supervised]).all() and supervised.any(1).all()
    n_copy = round(cfg.batch_size * cfg.copy_fraction)
    length = int((ids[0] != tokenizer.pad_token_id).sum())  # a copy row: <bos>, then a word sequence twice
    assert ids[0, 1:length // 2 + 1].tolist() == ids[0, length // 2 + 1:length].tolist() and n_copy > 0
    late = training_batch(tokenizer, cfg, 0, 99)["input_ids"]  # long contexts: fewer rows, fewer copies
    assert cfg.min_batch_size <= late.shape[0] < cfg.batch_size and late.shape[1] > cfg.context_min

    def copies(ids):
        return sum(row[1:(n + 1) // 2].tolist() == row[(n + 1) // 2:n].tolist()
                   for row, n in zip(ids, (ids != tokenizer.pad_token_id).sum(1).tolist()))
    assert copies(ids) == n_copy and copies(late) == round(late.shape[0] * cfg.copy_fraction_long)


@pytest.mark.parametrize("changes, problem", [
    ({"copy_fraction": 0.6, "recall_fraction": 0.6}, "copy_fraction \\(and copy_fraction_long\\) \\+"),
    ({"copy_fraction_long": 0.6}, "copy_fraction \\(and copy_fraction_long\\) \\+"),
    ({"recall_counts": 1.5}, "recall_counts must be in"),
    ({"curriculum_hold": 0.8, "curriculum_grow": 0.3}, "curriculum_hold \\+ curriculum_grow"),
    ({"train_context_short": 20}, "train_context_min <= train_context_short"),
    ({"min_batch_size": 64}, "min_batch_size <= batch_size"),
])
def test_recipe_keys_are_validated(changes, problem):
    with pytest.raises(ValueError, match=problem):
        validate(KvCompressConfig(**changes))
