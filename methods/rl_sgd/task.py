"""The verifiable task of `icml rl-sgd`: addition problems, the word-level tokenizer, user JSONL
data and the reward functions.

A problem is a (prompt, answer) pair of text: `407 + 95 =` and `502`. The tokenizer splits every
digit into its own word, so the model sees `<bos> 4 0 7 + 9 5 = 5 0 2 <eos>`. A user file of
{"prompt", "answer"} lines goes through the same records, so it replaces the generated problems
without another code path.
"""
from __future__ import annotations

import importlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
ARITHMETIC_WORDS = list("0123456789") + ["+", "="]
# Streams of the generator seeds, so the SFT set, RL prompts, band check and held-out set never share draws.
STREAM_SFT, STREAM_RL, STREAM_BAND, STREAM_EVAL = 1, 2, 3, 4


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


def addition(rng: random.Random, digits: tuple[int, int]) -> Problem:
    a, b = _operand(rng, digits[0]), _operand(rng, digits[1])
    return Problem(f"{a} + {b} =", str(a + b))


def stream_rng(seed: int, stream: int, index: int = 0) -> random.Random:
    """A generator for draw `index` of `stream`: reproducible whoever asks and in whatever order."""
    return random.Random(f"rl-sgd/{seed}/{stream}/{index}")


def problems_of(seed: int, stream: int, n: int, digits: int = 3, index: int = 0) -> list[Problem]:
    """n problems with two `digits`-digit operands (the spec's RL and held-out problems: 3 digits)."""
    rng = stream_rng(seed, stream, index)
    return [addition(rng, (digits, digits)) for _ in range(n)]


def sft_problems(seed: int, n: int, three_digit_frac: float) -> list[Problem]:
    """The SFT set: `three_digit_frac` of 3-digit problems, the rest with 1–2 digit operands."""
    rng = stream_rng(seed, STREAM_SFT)
    out = []
    for _ in range(n):
        if rng.random() < three_digit_frac:
            out.append(addition(rng, (3, 3)))
        else:
            out.append(addition(rng, (rng.randint(1, 2), rng.randint(1, 2))))
    return out


def load_jsonl(path: str | Path) -> list[Problem]:
    """{"prompt": str, "answer": str|number} per line; one-line ValueErrors name the bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"data '{path}' is not UTF-8 text — pass a JSONL file") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data '{path}' line {number} is not JSON ({exc.msg}) — one JSON object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or "answer" not in record:
            raise ValueError(f"data '{path}' line {number} lacks a string \"prompt\" and an \"answer\" — "
                             'write {"prompt": "...", "answer": "..."}')
        out.append(Problem(record["prompt"], str(record["answer"])))
    if len(out) < 2:
        raise ValueError(f"data '{path}' has {len(out)} problem(s) — it needs at least 2 (train and held-out)")
    return out


def split_user_data(problems: list[Problem], held_out_frac: float, cap: int, seed: int):
    """(train, held-out) of a user file: a seeded shuffle, then the last held_out_frac (≤ cap) held out."""
    order = list(problems)
    random.Random(f"rl-sgd/{seed}/split").shuffle(order)
    n_held = max(1, min(cap, int(round(held_out_frac * len(order)))))
    return order[:-n_held], order[-n_held:]


# tokenizer ------------------------------------------------------------------------------------
def build_tokenizer(words: list[str] | None = None):
    """The word-level `PreTrainedTokenizerFast`: specials, then `words` (default: digits, + and =).

    Pre-tokenisation isolates every digit and splits on whitespace, so `407 + 95 =` and
    `4 0 7 + 9 5 =` encode alike; decoding joins words with spaces. `<bos>` is prepended on encode.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for word in words if words is not None else ARITHMETIC_WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
    ])
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, clean_up_tokenization_spaces=False)


def words_of(problems: list[Problem]) -> list[str]:
    """The vocabulary a user file needs (digits are always separate words)."""
    words = set(ARITHMETIC_WORDS)
    for problem in problems:
        for text in (problem.prompt, problem.answer):
            words.update(w for w in re.split(r"(\d)|\s+", text) if w and not w.isspace())
    return sorted(words)


# rewards --------------------------------------------------------------------------------------
def exact_match(prompt: str, completion: str, answer: str) -> float:
    """The built-in task's reward: 1 iff the completion up to <eos> is the sum (spaces ignored)."""
    return float("".join(completion.split()) == "".join(answer.split()))


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normalise_number(text: str) -> str | None:
    text = text.replace(",", "")
    found = NUMBER.findall(re.sub(r"(?<=\d)\s+(?=\d)", "", text))
    if not found:
        return None
    value = found[-1]
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value.lstrip("+")


def last_number_match(prompt: str, completion: str, answer: str) -> float:
    """The default reward for user data: the completion's last number equals the answer's
    (commas dropped, digits joined across spaces, trailing decimal zeros ignored)."""
    got, want = _normalise_number(completion), _normalise_number(answer)
    return float(got is not None and got == want)


def load_reward(spec: str | None, user_data: bool) -> Callable[[str, str, str], float]:
    """`module:function`, or the default: exact match for the built-in task, last number for user data."""
    if spec is None:
        return last_number_match if user_data else exact_match
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward '{spec}': module '{module_name}' does not import ({exc}) — "
                         "put it on PYTHONPATH or fix the name") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"reward '{spec}': '{module_name}' has no callable '{function_name}' — "
                         "define def f(prompt, completion, answer) -> float")
    return function
