"""The synthetic "overthinking arithmetic" traces, their word tokenizer, and real problem files.

A problem is `Q 3 + 5 - 9 + 2 =` (3–6 single-digit operands, arithmetic mod 10). A trace solves it
left to right, `3 + 5 = 8 ; 8 - 9 = 9 ; 9 + 2 = 1 ans 1`, then re-checks it R times, each re-check
introduced by an action-transition word (`wait` 80 %, `hmm` 20 %), and ends `</think> F d <eos>`
with d copied from the last segment. R is drawn so that greedy decoding overthinks; re-checks slip
(extra thinking can hurt), first attempts fail and get fixed, and some traces loop on a wrong
segment until the jump phrase `wait no previous wrong restart` starts afresh.

Real problems are JSONL lines {"question": …, "answer": …}; answers are compared after
`normalise_answer` (the final answer's last `\\boxed{}`).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from icml.cli.errors import UsageError
from icml.data.text import SPECIAL, word_level_tokenizer

DIGITS = [str(d) for d in range(10)]
WORDS = ["+", "-", "=", ";", "Q", "ans", "F", "wait", "hmm", "no", "previous", "wrong", "restart",
         "<think>", "</think>"]
VOCAB = SPECIAL + DIGITS + WORDS
JUMP_PHRASE = ["wait", "no", "previous", "wrong", "restart"]
KINDS = ("clean", "first_error", "loop")


@dataclass
class Problem:
    problem_id: int
    question: str  # the prompt text before the thinking block, e.g. "Q 3 + 5 ="
    answer: str
    operands: tuple[int, ...] = ()
    ops: tuple[str, ...] = ()


@dataclass
class Trace:
    problem: Problem
    words: list[str]  # `<think> … </think> F d <eos>`
    kind: str  # clean | first_error | loop
    n_rechecks: int


def build_tokenizer():
    """The word-level tokenizer over VOCAB (`data.text.word_level_tokenizer`)."""
    return word_level_tokenizer(VOCAB)


# ---------------------------------------------------------------------------------------------
# Problems and traces
# ---------------------------------------------------------------------------------------------
def apply(acc: int, op: str, b: int) -> int:
    return (acc + b) % 10 if op == "+" else (acc - b) % 10


def solve(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    acc = operands[0]
    for op, b in zip(ops, operands[1:]):
        acc = apply(acc, op, b)
    return acc


def segment(operands: tuple[int, ...], ops: tuple[str, ...], slip: tuple[int, int] | None = None) -> list[str]:
    """The left-to-right chain; `slip` = (step, offset) puts one result off by a nonzero offset,
    and the error propagates to every later step (the next step starts from the slipped value)."""
    acc, words = operands[0], []
    for step, (op, b) in enumerate(zip(ops, operands[1:])):
        result = apply(acc, op, b)
        if slip is not None and slip[0] == step:
            result = (result + slip[1]) % 10
        words += [str(acc), op, str(b), "=", str(result)]
        words += [";"] if step < len(ops) - 1 else ["ans", str(result)]
        acc = result
    return words


def random_problem(rng: random.Random, problem_id: int, cfg) -> Problem:
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    operands = tuple(rng.randint(0, 9) for _ in range(n))
    ops = tuple(rng.choice("+-") for _ in range(n - 1))
    text = "Q " + " ".join(w for pair in zip(map(str, operands), ops + ("=",)) for w in pair)
    return Problem(problem_id, text, str(solve(operands, ops)), operands, ops)


def _slip(rng: random.Random, ops: tuple[str, ...]) -> tuple[int, int]:
    return rng.randrange(len(ops)), rng.randint(1, 9)


def _atp(rng: random.Random) -> str:
    return "wait" if rng.random() < 0.8 else "hmm"


def make_trace(rng: random.Random, problem: Problem, cfg) -> Trace:
    operands, ops = problem.operands, problem.ops
    n_rechecks = rng.choices(range(5), weights=cfg.recheck_weights)[0]
    u = rng.random()
    kind = "first_error" if u < cfg.first_error_rate else "loop" if u < cfg.first_error_rate + cfg.loop_rate \
        else "clean"

    def recheck() -> list[str]:
        slip = _slip(rng, ops) if rng.random() < cfg.slip_rate else None
        return [_atp(rng)] + segment(operands, ops, slip)

    if kind == "clean":
        body = segment(operands, ops)
        for _ in range(n_rechecks):
            body += recheck()
    elif kind == "first_error":  # the next re-check fixes the wrong first attempt
        n_rechecks = max(1, n_rechecks)
        body = segment(operands, ops, _slip(rng, ops)) + [_atp(rng)] + segment(operands, ops)
        for _ in range(n_rechecks - 1):
            body += recheck()
    else:  # loop: the wrong segment verbatim 1–2 more times, the jump phrase, a correct fresh segment
        wrong = segment(operands, ops, _slip(rng, ops))
        repeats = rng.randint(1, 2)
        body = list(wrong)
        for _ in range(repeats):
            body += [_atp(rng)] + wrong
        body += JUMP_PHRASE + segment(operands, ops)
        for _ in range(max(0, n_rechecks - repeats - 1)):
            body += recheck()
        n_rechecks = max(n_rechecks, repeats + 1)
    words = ["<think>"] + body + ["</think>", "F", body[-1], "<eos>"]  # d copies the last segment's answer
    return Trace(problem, words, kind, n_rechecks)


def generate_traces(cfg, seed: int, split: str, n: int) -> list[Trace]:
    """n traces of one split; trace i depends on (seed, split, i) alone."""
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}/{split}/{i}")
        out.append(make_trace(rng, random_problem(rng, i, cfg), cfg))
    return out


def held_out_problems(cfg, seed: int, n: int) -> list[Problem]:
    """Test problems from a seed stream of their own (never a training or validation trace's)."""
    return [random_problem(random.Random(f"{seed}/test/{i}"), i, cfg) for i in range(n)]


def encode_trace(trace: Trace, vocab: dict[str, int]) -> tuple[list[int], int]:
    """Ids of `<bos> question <think> … <eos>` and the index of `<think>` (the loss covers the
    tokens after it: the question itself is random and never generated)."""
    words = ["<bos>"] + trace.problem.question.split() + trace.words
    return [vocab[w] for w in words], 1 + len(trace.problem.question.split())


# ---------------------------------------------------------------------------------------------
# Real problem files and answers
# ---------------------------------------------------------------------------------------------
def load_jsonl(path: str | Path) -> list[Problem]:
    """JSONL lines {"question": str, "answer": str|number}; a bad line is a one-line UsageError."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"data '{path}' is not a text file", "pass a JSONL file with question/answer") from None
    problems = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"data '{path}' line {number} is not valid JSON ({exc.msg})",
                             "write one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or \
                not isinstance(row.get("answer"), (str, int, float)) or isinstance(row.get("answer"), bool):
            raise UsageError(f"data '{path}' line {number} lacks a string 'question' or an 'answer'",
                             'write {"question": "...", "answer": "..."} per line')
        problems.append(Problem(len(problems), row["question"], str(row["answer"])))
    if not problems:
        raise UsageError(f"data '{path}' holds no problems", "write one JSON object per line")
    return problems


def read_answer(text: str, terminator: str = "}") -> tuple[str, bool]:
    """The answer at the start of `text`: the text before the first `terminator` that is not inside a
    {…} group the answer opened itself, and whether that terminator came. With "}" it is brace
    matching: `\\frac{3}{4}} …` reads `\\frac{3}{4}`, not `\\frac{3`. The one reader of the final
    answer (`last_boxed`) and of the controller's probe answer, so the two never disagree."""
    depth = 0
    for i, char in enumerate(text):
        if depth == 0 and text.startswith(terminator, i):
            return text[:i], True
        if char == "{":
            depth += 1
        elif char == "}" and depth:
            depth -= 1
    return text, False


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{…} (braces matched; unclosed: what there is), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    return read_answer(text[start + len("\\boxed{"):])[0]


def normalise_answer(text: str | None) -> str | None:
    """A comparable form of an answer: no spaces, $, \\left/\\right, trailing period, thousands
    separators; \\dfrac/\\tfrac → \\frac; integral numbers without a fractional part."""
    if text is None:
        return None
    s = text.strip()
    inner = last_boxed(s)
    s = inner if inner is not None else s
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("$", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", "")):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d+", s) and float(s) == int(float(s)):
        s = str(int(float(s)))
    return s or None


def extract_answer(final_text: str, boxed: bool) -> str | None:
    """The answer of a generation's final part (after the thinking block): the last \\boxed{} for
    real models, the word after the last `F` for the synthetic traces."""
    if boxed:
        inner = last_boxed(final_text)
        return normalise_answer(inner if inner is not None else final_text)
    words = final_text.split()
    if "F" not in words:
        return None
    at = len(words) - 1 - words[::-1].index("F")
    return words[at + 1] if at + 1 < len(words) and words[at + 1] in DIGITS else None
