"""Evaluation of one example under every variant and ratio: one full prefill per mode, the
full-cache answer logits computed once, then per (variant, ratio) compress → ragged cache →
decode the prompt's last tokens and the teacher-forced answer through it."""
from __future__ import annotations

import re
import string
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from icml.cli.errors import UsageError
from icml.methods.kv_compress import compress as kv
from icml.methods.kv_compress.data import Example
from icml.methods.kv_compress.model import Prefill, RaggedCache, extend, prefill, sliding_window


PUNCTUATION = frozenset(string.punctuation)


@dataclass(frozen=True)
class Variant:
    name: str
    allocation: str  # full | uniform | pyramid | adakv | entropy
    operator: str  # none | snapkv | h2o | streamingllm
    question_aware: bool
    alpha: float | None = None
    scope: str | None = None


def variant_spec(name: str, cfg) -> Variant:
    aware = cfg.question_aware
    fixed = {"full": Variant(name, "full", "none", aware),
             "snapkv": Variant(name, "uniform", "snapkv", aware),
             "h2o": Variant(name, "uniform", "h2o", aware),
             "streamingllm": Variant(name, "uniform", "streamingllm", aware),
             "pyramidkv": Variant(name, "pyramid", "snapkv", aware),
             "adakv": Variant(name, "adakv", "snapkv", aware)}
    if name in fixed:
        return fixed[name]
    entro = {"entrokv_snapkv": ("snapkv", cfg.alpha, cfg.scope, aware),
             "entrokv_h2o": ("h2o", cfg.alpha, cfg.scope, aware),
             "entrokv_streamingllm": ("streamingllm", cfg.alpha, cfg.scope, aware),
             "entrokv_alpha0": ("snapkv", 0.0, cfg.scope, aware),
             "entrokv_alpha1": ("snapkv", 1.0, cfg.scope, aware),
             "entrokv_perlayer": ("snapkv", cfg.alpha, "per_layer", aware),
             "entrokv_qagnostic": ("snapkv", cfg.alpha, cfg.scope, False),
             # the second α (`--preset real`: α ∈ {0.25, 0.5} in both scopes)
             "entrokv_alpha0.25": ("snapkv", 0.25, cfg.scope, aware),
             "entrokv_perlayer_alpha0.25": ("snapkv", 0.25, "per_layer", aware)}
    operator, alpha, scope, aware = entro[name]
    return Variant(name, "entropy", operator, aware, alpha, scope)


@dataclass
class Analysis:
    """Window attention and entropy of one prefill, shared by the variants of an example; their
    measured times are charged to every variant that uses them."""

    attentions: list[torch.Tensor]  # [Hq, w, N] per layer
    entropy: np.ndarray  # H_l^h [L, Hkv]
    attention_ms: float
    entropy_ms: float


def window_attentions(state: Prefill) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(A, log A) [Hq, w, N] per layer: the last window's queries against all keys."""
    log_attentions = [kv.window_log_attention(q, k, state.scaling) for q, k in zip(state.window_queries, state.keys)]
    return [a.exp() for a in log_attentions], log_attentions


def analyse(state: Prefill, cfg) -> Analysis:
    start = time.perf_counter()
    attentions, log_attentions = window_attentions(state)
    middle = time.perf_counter()
    entropy = kv.kv_head_entropy(state, log_attentions, cfg.entropy_norm, cfg.gqa_agg)
    end = time.perf_counter()
    return Analysis(attentions, entropy, 1000 * (middle - start), 1000 * (end - middle))


def compress(state: Prefill, analysis: Analysis, spec: Variant, ratio: float, cfg,
             h_bar: float | None) -> kv.Selection:
    """Scores, budgets and kept positions of one variant at one ratio."""
    L, n_kv, _ = state.shape
    n, w = state.n, cfg.window
    scores = None
    if spec.operator == "snapkv":
        scores = [kv.snapkv_scores(a, n_kv, cfg.kernel, cfg.pool) for a in analysis.attentions]
    elif spec.operator == "h2o":
        scores = [kv.h2o_scores(c, n_kv, w) for c in state.column_sums]
    signal = None
    if spec.allocation == "full":
        budget = np.full((L, n_kv), n - w, dtype=np.int64)
        raw = budget.astype(float)
    elif spec.allocation == "uniform":
        budget = kv.uniform_budgets((L, n_kv), n, w, ratio)
        raw = budget.astype(float)
    elif spec.allocation == "pyramid":
        raw, budget = kv.pyramid_budgets((L, n_kv), n, w, ratio, cfg.pyramid_beta)
    elif spec.allocation == "adakv":
        mean = kv.uniform_capacity(n, w, ratio) - w
        budget = np.stack([kv.adakv_budgets(s, mean, cfg.adakv_floor) for s in scores])
        raw = budget.astype(float)
    else:
        signal = kv.stabilised_signal(analysis.entropy, spec.alpha, h_bar)
        raw, budget = kv.entropy_budgets(signal, n, w, ratio, spec.scope)
    kept = kv.select("streamingllm" if spec.operator == "streamingllm" else "scores", scores, budget, n, w,
                     cfg.sinks) if spec.allocation != "full" else \
        [[torch.arange(n) for _ in range(n_kv)] for _ in range(L)]
    return kv.Selection(kept, raw, budget, signal)


def charged_ms(analysis: Analysis, spec: Variant) -> float:
    """The shared analysis time a variant would pay on its own."""
    uses_window = spec.operator == "snapkv" or spec.allocation == "entropy"
    return (analysis.attention_ms if uses_window else 0.0) + \
        (analysis.entropy_ms if spec.allocation == "entropy" else 0.0)


@dataclass
class Split:
    """Token ids of one example: the prefilled part, then the tail decoded through the cache."""

    prefix: torch.Tensor
    tail: torch.Tensor  # the prompt tokens after the prefix, then the answer minus its last token
    answer: torch.Tensor

    def answer_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[-len(self.answer):]


def encode_parts(tokenizer, example: Example) -> tuple[list[int], list[int], list[int]]:
    context = tokenizer(example.context)["input_ids"]
    question = tokenizer(f" {example.question}", add_special_tokens=False)["input_ids"]
    answer = tokenizer(f" {example.answer}", add_special_tokens=False)["input_ids"]
    return context, question, answer


def check_lengths(tokenizer, examples: list[Example], cfg, model, source: str, agnostic: bool) -> None:
    """Refuse, in one line, an example this evaluation cannot run as specified: a prefill no longer
    than the observation window (no entry to select from), or a sequence longer than the sliding
    window of a checkpoint whose layers attend to their last W keys only (our forward attends to
    every kept key, so its logits would differ from the model's own past W positions)."""
    window = sliding_window(model.config)
    for example in examples:
        context, question, answer = encode_parts(tokenizer, example)
        where = f"line {example.line}" if example.line is not None else f"example {example.example_id}"
        prefill_length = len(context) if agnostic else len(context) + len(question) - 1
        if prefill_length <= cfg.window:
            raise UsageError(f"{source} {where} has a {prefill_length}-token prefill (context"
                             f"{'' if agnostic else ' + question but its last token'}), not longer than the "
                             f"observation window ({cfg.window})",
                             f"give it at least {cfg.window + 1} such tokens, or lower --set window=")
        generated = max(len(answer) - 1, cfg.max_new_tokens if cfg.scoring == "f1" else 0)
        total = len(context) + len(question) + generated
        if window is not None and total > window:
            raise UsageError(f"{source} {where} needs {total} positions, but this checkpoint's sliding-window "
                             f"layers attend to their last {window} keys only, which kv-compress does not model",
                             f"keep prompt + answer within {window} tokens, or use a full-attention checkpoint")


def score_metric(cfg) -> str:
    """The per-example score: exact_match (greedy = reference, token by token, teacher-forced) or
    token_f1 (free greedy answer, best F1 over the line's references, as LongBench scores)."""
    return "token_f1" if cfg.scoring == "f1" else "exact_match"


def split(tokenizer, example: Example, question_aware: bool, device: str) -> Split:
    """Question-aware: prefill context + question but its last token (the question lies in the
    window; the last token is decoded through the compressed cache, so the first answer position
    sees only kept entries). Question-agnostic: prefill the context alone, decode the question."""
    context, question, answer = encode_parts(tokenizer, example)
    prompt = context + question
    cut = len(prompt) - 1 if question_aware else len(context)
    as_tensor = lambda ids: torch.tensor(ids, device=device)  # noqa: E731
    return Split(as_tensor(prompt[:cut]), as_tensor(prompt[cut:] + answer[:-1]), as_tensor(answer))


@dataclass
class Outcome:
    correct: float  # exact match of the teacher-forced reference
    answer_nll: float
    kl_to_full: float
    first_logprobs: torch.Tensor


def score_cache(model, cache: RaggedCache, parts: Split, full_first: torch.Tensor | None) -> Outcome:
    logits, _ = extend(model, cache, parts.tail)
    answer = parts.answer_logits(logits).log_softmax(-1)
    nll = float(-answer.gather(1, parts.answer[:, None]).mean())
    correct = float(bool((answer.argmax(-1) == parts.answer).all()))  # greedy == gold, token by token
    kl = 0.0 if full_first is None else float((full_first.exp() * (full_first - answer[0])).sum())
    return Outcome(correct, nll, kl, answer[0])


def normalize_answer(text: str) -> str:
    """LongBench's (SQuAD's) answer normalisation: lower-case, drop ASCII punctuation, drop the
    articles a / an / the, collapse whitespace — so "66226." and "The 66226" both become "66226"."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(predicted: str, gold: str) -> float:
    """LongBench's qa_f1_score: F1 of the multiset overlap of the normalised tokens; 0 without overlap
    (an empty prediction or reference included, as LongBench scores it)."""
    p, g = normalize_answer(predicted).split(), normalize_answer(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def greedy_answer(model, tokenizer, cache: RaggedCache, parts: Split, max_new: int) -> str:
    """Free greedy decoding through the compressed cache (for token F1 on user data)."""
    prompt_tail = parts.tail[:len(parts.tail) - len(parts.answer) + 1]
    logits, cache = extend(model, cache, prompt_tail)
    out = []
    for _ in range(max_new):
        token = int(logits[-1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        logits, cache = extend(model, cache, torch.tensor([token], device=parts.tail.device))
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def evaluate_example(model, tokenizer, example: Example, cfg, specs: list[Variant], ratios: list[float],
                     h_bar: float | None, device: str) -> tuple[list[dict], list[dict]]:
    """Per-(variant, ratio) result rows and allocation rows of one example. One prefill mode at a time
    (question-aware, then question-agnostic if a variant asks for it): its K/V, window attention and caches
    are freed before the next, so that a long prompt holds one prefill (README, paper preset)."""
    modes = [True] + ([False] if any(not spec.question_aware for spec in specs) else [])
    parts = {aware: split(tokenizer, example, aware, device) for aware in modes}
    full = None
    scored: dict[tuple[int, int], tuple[dict, list[dict]]] = {}
    for aware in modes:
        state = prefill(model, parts[aware].prefix, cfg.window)
        analysis = analyse(state, cfg)
        if full is None:  # once per example, reused for every KL
            full = score_cache(model, RaggedCache.from_prefill(state, [[torch.arange(state.n)] * state.shape[1]]
                                                               * state.shape[0]), parts[True], None)
        for r, ratio in enumerate(ratios):
            for s, spec in enumerate(specs):
                if spec.question_aware == aware:
                    scored[r, s] = score_variant(model, tokenizer, example, cfg, spec, ratio, state, parts[aware],
                                                 analysis, full, h_bar)
        del state, analysis
    results, allocations = [], []
    for r in range(len(ratios)):
        for s in range(len(specs)):
            row, alloc = scored[r, s]
            results.append(row)
            allocations += alloc
    return results, allocations


def score_variant(model, tokenizer, example: Example, cfg, spec: Variant, ratio: float, state: Prefill, part: Split,
                  analysis: Analysis, full: Outcome, h_bar: float | None) -> tuple[dict, list[dict]]:
    """The result row and allocation rows of one variant at one ratio."""
    start = time.perf_counter()
    selection = compress(state, analysis, spec, ratio, cfg, h_bar)
    cache = RaggedCache.from_prefill(state, selection.kept)
    overhead = 1000 * (time.perf_counter() - start) + charged_ms(analysis, spec)
    entries, memory = cache.entries(), cache.memory_bytes()
    outcome = full if spec.allocation == "full" else score_cache(model, cache, part, full.first_logprobs)
    correct = outcome.correct
    if cfg.scoring == "f1":
        held = [cache]
        del cache  # greedy decoding's caches replace this one: no reference here keeps it alive
        predicted = greedy_answer(model, tokenizer, held.pop(), part, cfg.max_new_tokens)
        correct = max(token_f1(predicted, reference) for reference in example.answers or (example.answer,))
    L, n_kv, _ = state.shape
    budgets = selection.budget.astype(float)
    row = {"variant": spec.name, "task": example.task, "ratio": ratio,
           "example_id": example.example_id, "line": example.line, score_metric(cfg): correct,
           "answer_nll": outcome.answer_nll, "kl_to_full": outcome.kl_to_full,
           "kept_entries": entries, "kept_fraction": entries / (L * n_kv * state.n),
           "memory_bytes": memory, "overhead_ms": overhead,
           "budget_cv": budgets.std() / budgets.mean(),
           "mean_entropy": float(analysis.entropy.mean())}
    allocations = []
    for layer in range(L):
        for head in range(n_kv):
            allocations.append({
                "variant": spec.name, "task": example.task, "ratio": ratio,
                "example_id": example.example_id, "layer": layer, "kv_head": head,
                "entropy": float(analysis.entropy[layer, head]),
                "signal": float(selection.signal[layer, head]) if selection.signal is not None else np.nan,
                "budget_raw": float(selection.budget_raw[layer, head]),
                "budget": int(selection.budget[layer, head]),
                "kept": len(selection.kept[layer][head])})
    return row, allocations
