"""Long-context tasks of `icml kv-compress`: the word vocabulary, its tokenizer, the three
generated tasks and the loader of user JSONL files.

An example is a context, a question and a gold answer (word strings). The prompt is
`<bos> context question =`: the cue `=` (our addition to the spec's vocabulary) closes every
prompt, so in question-aware mode the whole question lies in the observation window while the
cue itself is decoded through the compressed cache (see model.py).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from icml.cli.errors import UsageError
from icml.data.text import SPECIAL, word_level_tokenizer

KEYS = [f"k{i}" for i in range(40)]
VALUES = [f"v{i}" for i in range(10)]
FILLER = [f"f{i}" for i in range(30)]
DIGITS = [str(i) for i in range(10)]
VOCAB = SPECIAL + KEYS + VALUES + FILLER + DIGITS + [";", "?", "count", "magic", "="]
CUE = "="


@dataclass
class Example:
    task: str
    example_id: int
    context: str
    question: str
    answer: str  # the reference the answer is teacher-forced on (the first of `answers`)
    more: tuple[tuple[str, str], ...] = ()  # further (question, answer) pairs: training sequences only
    answers: tuple[str, ...] = ()  # every reference answer of a --data line (token F1 takes the best)
    line: int | None = None  # the line of a --data file it came from


def build_tokenizer():
    """The word-level tokenizer over VOCAB (`data.text.word_level_tokenizer`)."""
    return word_level_tokenizer(VOCAB)


def _scatter(rng: random.Random, items: list[list[str]], length: int) -> list[str]:
    """Place the multi-token `items` in order-free random slots of a filler stream of `length` tokens."""
    n_filler = length - sum(len(item) for item in items)
    slots = sorted(rng.randint(0, n_filler) for _ in items)
    rng.shuffle(items)
    filler = [rng.choice(FILLER) for _ in range(n_filler)]
    out, start = [], 0
    for slot, item in zip(slots, items):
        out += filler[start:slot] + item
        start = slot
    return out + filler[start:]


def _pairs(rng: random.Random, length: int) -> list[tuple[str, str]]:
    """24–40 pairs; short training contexts (below 160 tokens) hold at most length/4 of them."""
    cap = max(2, length // 4)
    keys = rng.sample(KEYS, rng.randint(min(24, cap), min(40, cap)))
    return [(k, rng.choice(VALUES)) for k in keys]


def generate(task: str, example_id: int, rng: random.Random, context_min: int, context_max: int,
             n_questions: int = 1) -> Example:
    """One example; with n_questions > 1 (training) the same context carries further distinct
    questions about it (needle has only one)."""
    length = rng.randint(context_min, context_max)
    if task == "kv_retrieval":
        pairs = _pairs(rng, length)
        asked = rng.sample(pairs, min(n_questions, len(pairs)))
        context = _scatter(rng, [[k, v, ";"] for k, v in pairs], length)
        qa = [(f"? {key}", value) for key, value in asked]
    elif task == "needle":
        value = rng.choice(VALUES)
        context = _scatter(rng, [["magic", value, ";"]], length)
        qa = [("? magic", value)]
    elif task == "aggregation":
        pairs = _pairs(rng, length)
        asked = rng.sample(VALUES, min(n_questions, len(VALUES)))
        context = _scatter(rng, [[k, v, ";"] for k, v in pairs], length)
        qa = [(f"count {value} ?", str(sum(v == value for _, v in pairs) % 10)) for value in asked]
    else:
        raise ValueError(f"unknown task '{task}'")
    (question, answer), *more = [(f"{q} {CUE}", a) for q, a in qa]
    return Example(task, example_id, " ".join(context), question, answer, tuple(more))


# ---------------------------------------------------------------------------------------------
# Dense training sequences (training only; README "Training recipe"). Each returns the words after
# `<bos>` and which of them are loss targets; every target is predictable from its prefix (in a
# cue copy, up to words that occur twice in its first part).
# ---------------------------------------------------------------------------------------------
def copy_sequence(rng: random.Random, length: int) -> tuple[list[str], list[bool]]:
    """length//2 random words, then the same words again; targets: the repetition after its first word.
    Only a lookup of the earlier occurrence predicts a repeated word: the query is the current word."""
    half = [rng.choice(KEYS + VALUES + FILLER) for _ in range(length // 2)]
    return half + half, [False] * (len(half) + 1) + [True] * (len(half) - 1)


def cue_copy_sequence(rng: random.Random, length: int) -> tuple[list[str], list[bool]]:
    """m = length//3 random words x1…xm, then `x1 = x2 = … = xm`; targets: the word after each `=`, the
    one that followed the word before the cue in the first part. This is the match `? k =` needs: the
    query is the token BEFORE the cue, compared with positions whose previous token equals it. A plain
    copy matches the current token instead, and that circuit alone never served the lookup (README)."""
    first = [rng.choice(KEYS + VALUES + FILLER) for _ in range(max(3, length // 3))]
    words, targets = first + [first[0]], [False] * (len(first) + 1)
    for word in first[1:]:
        words += [CUE, word]
        targets += [False, True]
    return words, targets


def _ask_until(rng: random.Random, words: list[str], pairs: list[tuple[str, str]],
               length: int) -> tuple[list[str], list[bool]]:
    """`words` (no targets), then retrieval queries `? k = v` on uniformly drawn pairs (with
    replacement) until >= `length` words; targets: the answers v."""
    targets = [False] * len(words)
    while len(words) < length:
        key, value = rng.choice(pairs)
        words = words + ["?", key, CUE, value]
        targets += [False, False, False, True]
    return words, targets


def recall_sequence(rng: random.Random, length: int, n_pairs: tuple[int, int]) -> tuple[list[str], list[bool]]:
    """Dense multi-query associative recall without filler: n ∈ n_pairs pairs `k v ;` (unique keys),
    then `? k = v` queries to the end. Few pairs and many queries: where the lookup forms."""
    keys = rng.sample(KEYS, rng.randint(*n_pairs))
    pairs = [(key, rng.choice(VALUES)) for key in keys]
    return _ask_until(rng, [w for key, value in pairs for w in (key, value, ";")], pairs, length)


def _count_until(rng: random.Random, words: list[str], pairs: list[tuple[str, str]],
                 length: int) -> tuple[list[str], list[bool]]:
    """`words` (no targets), then count queries `count v ? = n` until >= `length` words."""
    targets = [False] * len(words)
    while len(words) < length:
        value = rng.choice(VALUES)
        words = words + ["count", value, "?", CUE, str(sum(v == value for _, v in pairs) % 10)]
        targets += [False, False, False, False, True]
    return words, targets


def count_sequence(rng: random.Random, length: int) -> tuple[list[str], list[bool]]:
    """Dense counting without filler: 2 … length/6 pairs `k v ;` (unique keys), then count queries
    `count v ? = n` (v uniform over the values, n = pairs with value v, mod 10) to the end."""
    keys = rng.sample(KEYS, rng.randint(2, max(2, min(len(KEYS), length // 6))))
    pairs = [(key, rng.choice(VALUES)) for key in keys]
    return _count_until(rng, [w for key, value in pairs for w in (key, value, ";")], pairs, length)


def _task_context(rng: random.Random, length: int) -> tuple[list[str], list[tuple[str, str]]]:
    """(words, pairs) of a context built as the tasks build theirs (24–40 pairs `k v ;` among filler,
    at most length/4 of them in short rows) over 3/4 of `length`."""
    context_length = max(8, int(0.75 * length))
    pairs = _pairs(rng, context_length)
    return _scatter(rng, [[k, v, ";"] for k, v in pairs], context_length), pairs


def context_recall_sequence(rng: random.Random, length: int) -> tuple[list[str], list[bool]]:
    """A task context, then `? k = v` queries to the end: the lookup at the evaluation's density,
    many answers per row."""
    words, pairs = _task_context(rng, length)
    return _ask_until(rng, words, pairs, length)


def context_count_sequence(rng: random.Random, length: int) -> tuple[list[str], list[bool]]:
    """A task context, then count queries `count v ? = n` (v uniform over the values, n = pairs with
    value v, mod 10) to the end: aggregation with many answers per row."""
    words, pairs = _task_context(rng, length)
    return _count_until(rng, words, pairs, length)


def generate_set(tasks: list[str], n_per_task: int, seed: int, context_min: int, context_max: int,
                 stream: str) -> list[Example]:
    """Deterministic from (seed, stream): train/val/calibration/test streams never share examples."""
    rng = random.Random(f"{seed}/{stream}")
    return [generate(task, i, rng, context_min, context_max) for task in tasks for i in range(n_per_task)]


def load_jsonl(path: str | Path) -> list[Example]:
    """A user file: one JSON object per line with context/question/answer, or LongBench's
    context/input/answers (every answer is a reference; the first is the one teacher-forced)."""
    path = Path(path)
    examples = []
    task = path.stem
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"--data '{path}' is not UTF-8 text", "pass a JSONL file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--data '{path}' line {number} is not valid JSON ({exc.msg})",
                             "write one JSON object per line") from None
        if not isinstance(record, dict):
            raise UsageError(f"--data '{path}' line {number} is not a JSON object",
                             "write objects with context/question/answer")
        question = record.get("question", record.get("input"))
        answers = record.get("answer", record.get("answers"))
        answers = answers if isinstance(answers, list) else [answers]
        if not isinstance(record.get("context"), str) or not isinstance(question, str) \
                or not answers or not all(isinstance(a, str) for a in answers):
            raise UsageError(f"--data '{path}' line {number} lacks string fields context, question/input "
                             "and answer/answers", "give every line context, question and answer")
        examples.append(Example(task, len(examples), record["context"], question, answers[0],
                                answers=tuple(answers), line=number))
    if not examples:
        raise UsageError(f"--data '{path}' holds no examples", "write one JSON object per line")
    return examples
