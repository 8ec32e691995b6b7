"""kv-compress training data: every supervised token of the dense sequences is the answer its
prefix determines (checked by an independent replay), the row mixture and curriculum are exact and
deterministic from (seed, step), and the recipe's config keys are validated."""
from __future__ import annotations

import random

import pytest

from icml.methods.kv_compress.config import KvCompressConfig, row_mixture, validate
from icml.methods.kv_compress.data import (CUE, FILLER, KEYS, VALUES, build_tokenizer, context_count_sequence,
                                           context_recall_sequence, copy_sequence, count_sequence, cue_copy_sequence,
                                           recall_sequence)
from icml.methods.kv_compress.training import context_range, row_counts, training_batch


def _replay(words: list[str]) -> list[bool]:
    """Which words a reader who only knows the format can predict, asserting each prediction: the value
    of `? k =` once `k v ;` was seen (a key is never paired twice), the count digit of `count v ? =`."""
    pairs: dict[str, str] = {}
    predicted = []
    for i, word in enumerate(words):
        before = words[max(0, i - 4):i]
        if word in VALUES and before[-1:] and before[-1] in KEYS and before[-2:-1] != ["?"]:
            assert words[i + 1] == ";" and before[-1] not in pairs  # a pair is `k v ;`, keys unique
            pairs[before[-1]] = word
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


@pytest.mark.parametrize("builder", ["recall", "count", "context_recall", "context_count"])
def test_recall_targets_are_exactly_the_predictable_answers(builder):
    rng = random.Random(7)
    for _ in range(60):
        length = rng.randint(16, 320)
        if builder in ("recall", "count"):
            words, targets = (recall_sequence(rng, length, (2, 8)) if builder == "recall"
                              else count_sequence(rng, length))
            n_pairs = (words.index("?") - 2 * (builder == "count")) // 3
            most = 8 if builder == "recall" else max(2, length // 6)
            assert 2 <= n_pairs <= most and not set(words) & set(FILLER)  # no filler in a dense row
        else:
            sequence = context_recall_sequence if builder == "context_recall" else context_count_sequence
            words, targets = sequence(rng, length)
            first_query = words.index("?") - (builder == "context_count") * 2  # `count v ?` starts 2 earlier
            assert first_query == max(8, int(0.75 * length))  # the context fills 3/4 of the row
        assert len(words) == len(targets) and length <= len(words) < length + 5
        assert targets == _replay(words) and any(targets)


def test_cue_copy_targets_follow_the_word_before_the_cue():
    for length in (16, 41, 96, 320):
        words, targets = cue_copy_sequence(random.Random(length), length)
        m = max(3, length // 3)
        first, second = words[:m], words[m:]
        assert second == [first[0]] + [w for x in first[1:] for w in (CUE, x)]
        assert targets == [False] * (m + 1) + [False, True] * (m - 1)
        for i in (i for i, t in enumerate(targets) if t):  # the answer follows, in the first part, an
            previous = words[i - 2]  # occurrence of the word before the cue
            assert words[i - 1] == CUE and any(first[j] == previous and first[j + 1] == words[i] for j in range(m - 1))


def test_dense_sequences_are_deterministic():
    for builder in (lambda r: recall_sequence(r, 200, (2, 8)), lambda r: context_recall_sequence(r, 200),
                    lambda r: context_count_sequence(r, 200), lambda r: count_sequence(r, 100),
                    lambda r: cue_copy_sequence(r, 200), lambda r: copy_sequence(r, 64)):
        assert builder(random.Random(5)) == builder(random.Random(5)) != builder(random.Random(6))
    words, targets = copy_sequence(random.Random(3), 41)
    assert len(words) == 40 and words[:20] == words[20:] and targets == [False] * 21 + [True] * 19


@pytest.mark.parametrize("weights", [[1, 1, 1], [1, 1, 2, 2], [3], [0.5, 2.5]])
def test_row_counts_sum_to_the_batch_and_follow_the_weights(weights):
    mixture = [(f"k{i}", w) for i, w in enumerate(weights)]
    for rows in range(1, 65):
        counts = row_counts(mixture, rows)
        assert sum(counts) == rows and all(c >= 0 for c in counts)
        assert all(abs(c - rows * w / sum(weights)) < 1 for c, w in zip(counts, weights))
    assert row_counts([("a", 1), ("b", 1), ("c", 1)], 32) == [11, 10, 11]


def test_curriculum_holds_short_then_grows_to_eval_lengths():
    cfg = KvCompressConfig(steps=1000, curriculum_hold=0.4, curriculum_grow=0.3)
    assert context_range(0, cfg) == context_range(400, cfg) == (cfg.train_context_min, cfg.train_context_short)
    assert context_range(550, cfg) == (96, 192)  # halfway: 32→160 and 64→320
    assert context_range(700, cfg) == context_range(999, cfg) == (cfg.context_min, cfg.context_max)
    jump = KvCompressConfig(steps=10, curriculum_hold=0.5, curriculum_grow=0.0)
    assert context_range(4, jump) == (32, 64) and context_range(5, jump) == (160, 320)


def _kind(words: list[str]) -> str:
    if "?" not in words:
        return "cue_copy" if CUE in words else "copy"
    first_query = min(words.index("?"), words.index("count") if "count" in words else len(words))
    if set(words[:first_query]) & set(FILLER):
        return "context_row_or_task"
    return "count" if words[first_query] == "count" else "recall"


def test_training_batch_follows_the_mixture_and_is_deterministic():
    tokenizer = build_tokenizer()
    cfg = KvCompressConfig(steps=100)
    first = training_batch(tokenizer, cfg, 0, 3)
    assert all((first[k] == training_batch(tokenizer, cfg, 0, 3)[k]).all() for k in first)
    assert first["input_ids"].shape != training_batch(tokenizer, cfg, 0, 4)["input_ids"].shape \
        or (first["input_ids"] != training_batch(tokenizer, cfg, 0, 4)["input_ids"]).any()
    for step, mixture in ((3, cfg.rows_short), (99, cfg.rows_long)):
        batch = training_batch(tokenizer, cfg, 0, step)
        ids, labels = batch["input_ids"], batch["labels"]
        assert (ids[:, 0] == tokenizer.bos_token_id).all()
        supervised = labels != -100
        assert (labels[supervised] == ids[supervised]).all() and supervised.any(1).all()
        rows = [tokenizer.convert_ids_to_tokens([i for i in row[1:].tolist() if i != tokenizer.pad_token_id])
                for row in ids]
        kinds = [_kind(r) for r in rows]
        counts = dict(zip([k for k, _ in row_mixture(mixture)], row_counts(row_mixture(mixture), len(rows))))
        if step == 3:
            assert len(rows) == cfg.batch_size and set(counts) == {"copy", "cue_copy", "recall", "count"}
            assert all(kinds.count(kind) == counts[kind] for kind in counts)
        else:  # long contexts: fewer rows; context rows and the tasks all hold filler before `?`
            assert cfg.min_batch_size <= len(rows) < cfg.batch_size and ids.shape[1] > cfg.context_min
            assert all(kinds.count(kind) == counts[kind] for kind in ("copy", "cue_copy", "count"))
            assert kinds.count("context_row_or_task") == counts["context_recall"] + counts["context_count"] \
                + counts["tasks"]


@pytest.mark.parametrize("changes, problem", [
    ({"rows_short": "copy:1,induction:1"}, "rows_short: unknown row kind 'induction'"),
    ({"rows_long": "copy:-1"}, "rows_long: weight of 'copy' must be positive"),
    ({"rows_long": "copy:x"}, "rows_long: weight of 'copy' must be a number"),
    ({"recall_pairs": [5, 2]}, "recall_pairs must be min,max"),
    ({"curriculum_hold": 0.8, "curriculum_grow": 0.3}, "curriculum_hold \\+ curriculum_grow"),
    ({"train_context_short": 20}, "train_context_min <= train_context_short"),
    ({"min_batch_size": 64}, "min_batch_size <= batch_size"),
])
def test_recipe_keys_are_validated(changes, problem):
    with pytest.raises(ValueError, match=problem):
        validate(KvCompressConfig(**changes))
