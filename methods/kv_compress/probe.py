"""`icml kv-compress count-probe`: where a trained model gathers the occurrences of the counted
value, and whether SnapKV keeps them (README, "Why compressed aggregation moves between machines").

An aggregation prompt is `<bos> context count v ? =` and its answer the number of `k v ;` pairs of
the context whose value is v (mod 10): the count survives compression only if every occurrence of
v is kept. In the eval's question-aware protocol the prefill ends at `?`, so the observation
window's last two rows are the question's `v` and `?`, and the cue `=` (where the count is emitted)
is decoded after compression. History = prefill positions < N − w, the only ones that can be evicted.

Per prompt the probe measures
1. the share of the `?`, `v` and `=` rows' history attention that lies on the occurrences of v in
   the history, per layer, averaged over query heads (`=` with the full cache);
2. for SnapKV at ratio r (the eval's own `compress`), the share of those occurrences each KV head
   keeps, whether it keeps them all, and the blind floor: the probability that a random keep of the
   same budget keeps them all;
3. exact_match of full, of SnapKV, and of SnapKV scored by the `v` and `?` rows alone, through the
   eval's `score_cache`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from icml.cli import console
from icml.cli.errors import UsageError
from icml.cli.threads import single_thread
from icml.methods.kv_compress import compress as kv
from icml.methods.kv_compress.data import CUE, KEYS, Example
from icml.methods.kv_compress.evaluation import (Analysis, Split, analyse, check_lengths, compress, encode_parts,
                                                 score_cache, split, variant_spec)
from icml.methods.kv_compress.model import Prefill, RaggedCache, prefill
from icml.methods.kv_compress.pipeline import eval_examples, load_model

TABLE = "count_probe"  # <run>/count_probe.parquet
ROWS = ("?", "v", "=")  # the attention rows probed: question mark, asked value, cue
SNAPKV = "snapkv"
QUESTION_ROWS = "snapkv_question_rows"  # SnapKV scored by the `v` and `?` window rows alone
SELECTIONS = (SNAPKV, QUESTION_ROWS)
FULL = "full"
BLIND = "blind"  # a uniformly random keep of the same budget
KEY_WORDS = frozenset(KEYS)


# ---------------------------------------------------------------------------------------------
# Where the asked value occurs
# ---------------------------------------------------------------------------------------------
@dataclass
class CountingPrompt:
    example: Example
    parts: Split  # the eval's question-aware split: prefix = `<bos> context count v ?`, tail = `=`
    value: str  # the asked value word v
    occurrences: torch.Tensor  # sorted history positions of the value tokens of the pairs `k v ;`
    window_occurrences: int  # such pairs whose value token lies in the window (always kept)
    history: int  # N − w

    @property
    def n(self) -> int:
        return len(self.parts.prefix)


def locate(tokenizer, example: Example, window: int, device: str) -> CountingPrompt:
    """The prompt as the eval splits it, and the token positions of the asked value's occurrences."""
    words, question = example.context.split(), example.question.split()
    if example.task != "aggregation" or len(question) != 4 or question[0] != "count" or question[2:] != ["?", CUE]:
        raise ValueError(f"example {example.example_id} is not an aggregation prompt `count v ? =`")
    # Positions are read off the words, so the tokenizer must put context word i at token i + 1
    # (after <bos>) and the question word for word; the word-level tokenizer of the tiny model does.
    context_ids, question_ids, _ = encode_parts(tokenizer, example)
    if context_ids != [tokenizer.bos_token_id] + tokenizer.convert_tokens_to_ids(words) or \
            question_ids != tokenizer.convert_tokens_to_ids(question):
        raise UsageError("count-probe reads token positions off the words, and this run's tokenizer does not "
                         "map one word to one token after <bos>", "probe a run of the trained tiny model")
    value = question[1]
    pair_values = [i + 1 for i in range(1, len(words) - 1)
                   if words[i] == value and words[i - 1] in KEY_WORDS and words[i + 1] == ";"]
    parts = split(tokenizer, example, True, device)
    history = len(parts.prefix) - window
    in_history = [p for p in pair_values if p < history]
    return CountingPrompt(example, parts, value, torch.tensor(in_history, dtype=torch.long),
                          len(pair_values) - len(in_history), history)


# ---------------------------------------------------------------------------------------------
# 1. Attention on the occurrences
# ---------------------------------------------------------------------------------------------
def occurrence_share(log_attention: torch.Tensor, occurrences: torch.Tensor, history: int) -> torch.Tensor:
    """[Hq]: per query head, the share of one row's history attention that lies on `occurrences`,
    from its log-attention over the keys [Hq, keys]. Kept in log space, as compress.py does: a sharp
    head's history mass can underflow to 0 in probability space. No occurrence: share 0."""
    on_history = log_attention[:, :history]
    on_occurrences = on_history[:, occurrences.to(on_history.device)].logsumexp(-1)  # −inf for none
    return (on_occurrences - on_history.logsumexp(-1)).exp()


def cue_step(model, prompt: CountingPrompt) -> Prefill:
    """The decoding step of the cue `=` with the full cache. A causal prefill of prefix + `=` is that
    step: its last query attends to all N prefix keys and to itself, as `extend` through a cache that
    keeps everything does; window 1 keeps just that query."""
    return prefill(model, torch.cat([prompt.parts.prefix, prompt.parts.tail[:1]]), 1)


def row_attention(model, state: Prefill, prompt: CountingPrompt, window: int) -> dict[str, np.ndarray]:
    """[L] per row: the mean over query heads of occurrence_share. The `v` and `?` rows are the last
    two rows of the compressed prefill's window attention (the rows SnapKV votes with, recomputed
    in log space); the `=` row is the cue's decoding step with the full cache."""
    shares = {row: [] for row in ROWS}
    for queries, keys in zip(state.window_queries, state.keys):
        log_attention = kv.window_log_attention(queries, keys, state.scaling)  # [Hq, w, N]
        shares["v"].append(occurrence_share(log_attention[:, window - 2], prompt.occurrences, prompt.history))
        shares["?"].append(occurrence_share(log_attention[:, window - 1], prompt.occurrences, prompt.history))
    step = cue_step(model, prompt)
    for queries, keys in zip(step.window_queries, step.keys):
        log_attention = kv.window_log_attention(queries, keys, step.scaling)  # [Hq, 1, N + 1]
        shares["="].append(occurrence_share(log_attention[:, 0], prompt.occurrences, prompt.history))
    return {row: torch.stack(per_layer).mean(-1).double().cpu().numpy() for row, per_layer in shares.items()}


# ---------------------------------------------------------------------------------------------
# 2. Which occurrences SnapKV keeps, and the blind floor
# ---------------------------------------------------------------------------------------------
def question_row_analysis(analysis: Analysis) -> Analysis:
    """The window attention with every row but the last two (`v`, `?`) set to 0. SnapKV's vote is
    the window mean of the rows, so its scores become (sum of the two rows) / w: the two rows' mean
    times 2/w, the same order (exactly, for w a power of two), and snapkv_scores, the budgets and
    select of `compress` run unchanged."""
    window = analysis.attentions[0].shape[1]
    question_rows = torch.zeros(window, 1, device=analysis.attentions[0].device)
    question_rows[-2:] = 1
    return replace(analysis, attentions=[a * question_rows for a in analysis.attentions])


def kept_occurrences(kept: list[list[torch.Tensor]], occurrences: torch.Tensor) -> np.ndarray:
    """[L, Hkv]: the share of the occurrences each KV head keeps (NaN with no occurrence)."""
    if len(occurrences) == 0:
        return np.full((len(kept), len(kept[0])), np.nan)
    wanted = occurrences.numpy()
    return np.array([[np.isin(wanted, positions.cpu().numpy()).mean() for positions in heads] for heads in kept])


def blind_floor(history: int, budget: int, occurrences: int) -> float:
    """P(a uniformly random `budget` of the `history` positions holds `occurrences` given ones), the
    hypergeometric C(history − m, budget − m) / C(history, budget); 1 with no occurrence, 0 when they
    outnumber the budget. Integer binomials, so it is exact up to the final division."""
    if occurrences > budget:
        return 0.0
    return math.comb(history - occurrences, budget - occurrences) / math.comb(history, budget)


# ---------------------------------------------------------------------------------------------
# One prompt
# ---------------------------------------------------------------------------------------------
@dataclass
class PromptProbe:
    prompt: CountingPrompt
    attention: dict[str, np.ndarray]  # row → [L] share of its history attention on the occurrences
    selections: dict[str, kv.Selection]  # snapkv, snapkv_question_rows
    kept_share: dict[str, np.ndarray]  # selection → [L, Hkv] share of the occurrences kept
    exact_match: dict[str, float]  # full, snapkv, snapkv_question_rows
    budget: int  # history entries each KV head keeps
    floor: float  # blind floor of that budget


def probe_prompt(model, tokenizer, example: Example, cfg, ratio: float, device: str) -> PromptProbe:
    """Everything the probe measures on one aggregation prompt, along the eval's own path: the
    question-aware prefill, `analyse`, `compress` with the snapkv variant, the ragged cache and
    `score_cache`."""
    prompt = locate(tokenizer, example, cfg.window, device)
    state = prefill(model, prompt.parts.prefix, cfg.window)
    analysis = analyse(state, cfg)
    snapkv = variant_spec(SNAPKV, cfg)
    selections = {SNAPKV: compress(state, analysis, snapkv, ratio, cfg, None),
                  QUESTION_ROWS: compress(state, question_row_analysis(analysis), snapkv, ratio, cfg, None)}
    L, n_kv, _ = state.shape
    keep_all = [[torch.arange(state.n)] * n_kv] * L
    exact_match = {FULL: score_cache(model, RaggedCache.from_prefill(state, keep_all), prompt.parts, None).correct}
    for name, selection in selections.items():
        exact_match[name] = score_cache(model, RaggedCache.from_prefill(state, selection.kept), prompt.parts,
                                        None).correct
    budget = kv.uniform_capacity(state.n, cfg.window, ratio) - cfg.window  # the uniform budget snapkv uses
    return PromptProbe(prompt, row_attention(model, state, prompt, cfg.window), selections,
                       {name: kept_occurrences(s.kept, prompt.occurrences) for name, s in selections.items()},
                       exact_match, budget, blind_floor(prompt.history, budget, len(prompt.occurrences)))


def probe_rows(probe: PromptProbe) -> list[dict]:
    """Tidy rows (variant, layer, kv_head, row, metric, value) of one prompt; None where a column
    does not apply."""
    def row(metric, value, variant=None, layer=None, kv_head=None, attention_row=None) -> dict:
        return {"example_id": probe.prompt.example.example_id, "variant": variant, "layer": layer,
                "kv_head": kv_head, "row": attention_row, "metric": metric, "value": float(value)}

    prompt = probe.prompt
    rows = [row("n_occurrences", len(prompt.occurrences)), row("n_window_occurrences", prompt.window_occurrences),
            row("history_length", prompt.history), row("history_budget", probe.budget),
            row("blind_floor", probe.floor, BLIND)]
    rows += [row("exact_match", value, variant) for variant, value in probe.exact_match.items()]
    for attention_row, per_layer in probe.attention.items():
        rows += [row("occurrence_attention", share, FULL, layer, attention_row=attention_row)
                 for layer, share in enumerate(per_layer)]
    for variant, shares in probe.kept_share.items():
        all_kept = np.nan_to_num(shares, nan=1.0) == 1.0  # no occurrence: all (none) kept, as the floor counts it
        rows.append(row("all_kept_every_head", all_kept.all(), variant))
        for (layer, kv_head), share in np.ndenumerate(shares):
            rows += [row("kept_share", share, variant, layer, kv_head),
                     row("all_kept", all_kept[layer, kv_head], variant, layer, kv_head)]
    return rows


# ---------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------
def counting_prompts(cfg, seed: int, n: int | None) -> list[Example]:
    """The aggregation test prompts eval scores (its config and seed), the first n of them."""
    return [e for e in eval_examples(cfg, seed) if e.task == "aggregation"][:n]


def count_probe(run_path, run_id: str, cfg, seed: int, ratio: float, n: int | None, device: str) -> pd.DataFrame:
    """The probe's tidy table over a run's counting prompts (columns run_id, example_id, seed, ratio,
    variant, layer, kv_head, row, metric, value)."""
    model, tokenizer = load_model(run_path, cfg, None, device)
    examples = counting_prompts(cfg, seed, n)
    check_lengths(tokenizer, examples, cfg, model, "generated", agnostic=False)
    rows = []
    with console.progress("counting prompts", len(examples)) as advance, single_thread():
        for example in examples:
            rows += probe_rows(probe_prompt(model, tokenizer, example, cfg, ratio, device))
            advance(1)
    frame = pd.DataFrame(rows)
    frame.insert(0, "run_id", run_id)
    frame.insert(2, "seed", seed)
    frame.insert(3, "ratio", float(ratio))
    for column in ("layer", "kv_head"):
        frame[column] = frame[column].astype("Int64")
    return frame


def summarise(frame: pd.DataFrame) -> dict:
    """Means over prompts: the attention shares per row and layer (and their mean over layers) over
    the prompts with at least one occurrence in the history, where there is something to find;
    per selection the kept share (over those prompts too) and the all-kept rates (over all prompts,
    none kept counting as all); exact_match per variant; the blind floor."""
    def metric(name: str, variant: str | None = None) -> pd.DataFrame:
        rows = frame[frame["metric"] == name]
        return rows if variant is None else rows[rows["variant"] == variant]

    occurrences = metric("n_occurrences").set_index("example_id")["value"]
    found = occurrences.index[occurrences > 0]
    attention = metric("occurrence_attention")
    attention = attention[attention["example_id"].isin(found)]
    layers = sorted(metric("occurrence_attention")["layer"].unique())
    per_layer = attention.groupby(["row", "layer"])["value"].mean()
    summary = {"prompts": int(len(occurrences)), "prompts_with_occurrence": int(len(found)),
               "mean_occurrences": float(occurrences.mean()),
               "mean_window_occurrences": float(metric("n_window_occurrences")["value"].mean()),
               "history_budget": float(metric("history_budget")["value"].mean()),
               "history_length": float(metric("history_length")["value"].mean()),
               "occurrence_attention": {}}
    for row in ROWS:
        values = [float(per_layer.get((row, layer), np.nan)) for layer in layers]
        summary["occurrence_attention"][row] = {"per_layer": values,
                                                "mean_over_layers": float(np.mean(values)) if values else np.nan}
    for variant in SELECTIONS:
        shares = metric("kept_share", variant)["value"].dropna()  # prompts without an occurrence have none
        summary[variant] = {"kept_share": float(shares.mean()) if len(shares) else np.nan,
                            "all_kept": float(metric("all_kept", variant)["value"].mean()),
                            "all_kept_every_head": float(metric("all_kept_every_head", variant)["value"].mean())}
    scores = metric("exact_match").groupby("variant")["value"].mean()
    summary["exact_match"] = {variant: float(scores.get(variant, np.nan)) for variant in (FULL, *SELECTIONS)}
    summary["blind_floor"] = float(metric("blind_floor")["value"].mean())
    return summary
