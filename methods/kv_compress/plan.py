"""`icml kv-compress plan`: what one evaluation example (and, without --model, one training step of the tiny
model; with it, one calibration prompt) holds and computes, on the meta device (cli/plan.py).

The model: `--set model=DIR` (its config.json, headers only, through cli/checkpoints.py), else `plan_model`
(paper: Llama-3.1-8B's published sizes, built from a LlamaConfig, never downloaded), in float32 as the run
loads it. The prompt: `plan_tokens` tokens (paper: 32 768), else the generated tasks' longest.
The evaluation step is evaluate_example's memory: the question-aware prefill (blockwise, model.prefill; the
question-agnostic one comes after it is freed), its window attention and entropy maps, the full cache and one
compressed cache (r = the smallest ratio), one decoding step through each with the cache at full length. The budgets, the
selection's positions and the greedy loop read values on the host (numpy, `.item()`, argmax → int): they
are left out, and the kept positions are the budget's count of positions (their shapes are what matter)."""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step, lm_config
from icml.methods.kv_compress import compress as kv
from icml.methods.kv_compress.evaluation import variant_spec, window_attentions
from icml.methods.kv_compress.model import RaggedCache, extend, prefill

LAYOUT = "one process, one GPU (with --model; the tiny model trains under torchrun, DDP over the batch)"
OVERSIZE = ["plan_tokens=131072"]
QUESTION_TOKENS = 16  # the question's tokens: the question-agnostic prefill stops before them

def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _config(cfg):
    """(transformers config, vocab) of the model the plan sizes; (None, None): the tiny model."""
    if not cfg.model and cfg.plan_model == "tiny":
        return None, None
    config = lm_config(cfg.model, cfg.plan_model)
    return config, config.vocab_size


def _model(cfg, tracker):
    from transformers import AutoModelForCausalLM

    from icml.methods.kv_compress.data import build_tokenizer
    from icml.methods.kv_compress.model import tiny_model

    config, vocab = _config(cfg)
    with torch.device(tracker.device):
        if config is None:
            vocab = len(build_tokenizer())
            model = tiny_model(cfg, vocab, 0)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # load_causal_lm's dtype
    return model, vocab


def _tokens(cfg) -> int:
    return cfg.plan_tokens or cfg.context_max + QUESTION_TOKENS


def _prefill(model, cfg, vocab: int, n: int, tracker):
    ids = torch.randint(vocab, (n,), device=tracker.device)
    state = prefill(model, ids, cfg.window)
    tracker.buffer(*state.keys, *state.values, *state.window_queries, *state.column_sums)
    return state


def _analysis(state, cfg, tracker):
    attentions, log_attentions = window_attentions(state)
    entropy = kv.kv_head_entropy_tensor(state, log_attentions, cfg.entropy_norm, cfg.gqa_agg)
    tracker.buffer(*attentions)
    return attentions, entropy


def _kept(n: int, window: int, budget: int, layers: int, heads: int) -> list[list[torch.Tensor]]:
    """`budget` history positions and the window per head (which positions: a value the host reads)."""
    keep = torch.cat([torch.arange(budget), torch.arange(n - window, n)])
    return [[keep] * heads for _ in range(layers)]


def _eval(cfg):
    def run(tracker):
        model, vocab = _model(cfg, tracker)
        model.eval()
        tracker.watch(model)
        n, w = _tokens(cfg), cfg.window
        token = torch.randint(vocab, (1,), device=tracker.device)
        with torch.no_grad():  # the question-aware mode; the question-agnostic one follows it, shorter
            state = _prefill(model, cfg, vocab, n - 1, tracker)
            attentions, _ = _analysis(state, cfg, tracker)
            L, n_kv, _ = state.shape
            for history in (state.n - w, int(kv.uniform_budgets((L, n_kv), state.n, w, min(cfg.ratios))[0, 0])):
                if history < state.n - w:  # SnapKV's scores and selection (the positions: read on the host)
                    for layer_scores in (kv.snapkv_scores(a, n_kv, cfg.kernel, cfg.pool) for a in attentions):
                        kv.top_positions(layer_scores, history)
                cache = RaggedCache.from_prefill(state, _kept(state.n, w, history, L, n_kv))
                tracker.buffer(*cache.keys, *cache.values)
                extend(model, cache, token)  # one decoding step with the cache at full length
                del cache
    return run


def _calibrate(cfg):
    def run(tracker):
        model, vocab = _model(cfg, tracker)
        model.eval()
        tracker.watch(model)
        with torch.no_grad():
            _analysis(_prefill(model, cfg, vocab, _tokens(cfg) - 1, tracker), cfg, tracker)
    return run


def _train(cfg, processes: int):
    from icml.methods.kv_compress.data import build_tokenizer
    from icml.methods.kv_compress.model import tiny_model
    from icml.methods.kv_compress.training import lr_at, train_step, training_batch

    def run(tracker):
        tokenizer = build_tokenizer()
        with torch.device(tracker.device):
            model = tiny_model(cfg, len(tokenizer), 0)
        # training runs SDPA: a fused kernel on CUDA and CPU, its math decomposition on meta; eager attention holds
        # the same scores on every device, so the plan (an upper bound of SDPA's) is the CPU run's to the byte
        model.config._attn_implementation = "eager"
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        tracker.watch(model, optimizer)
        step = cfg.steps - 1  # the curriculum's longest contexts
        inputs = training_batch(tokenizer, cfg, 0, step)
        rows = max(1, -(-len(inputs["labels"]) // processes))  # this process's share of the global batch
        inputs = {key: value[:rows].to(tracker.device) for key, value in inputs.items()}
        for _ in range(2):  # the second step holds AdamW's state from its start
            train_step(model, model, optimizer, inputs, {}, lr_at(step, cfg))
    return run


def steps(cfg, processes: int) -> list[Step]:
    n = _tokens(cfg)
    name = cfg.model or (cfg.plan_model if cfg.plan_model != "tiny" else "the tiny Llama")
    out = []
    if cfg.model or cfg.plan_model != "tiny":
        out.append(Step("train", f"calibrate (train with --model only calibrates): one {n}-token prompt of "
                                 f"{name}, prefill + window attention and entropy", _calibrate(cfg)))
    else:
        out.append(Step("train", "an AdamW step of the tiny Llama on the curriculum's longest batch",
                        _train(cfg, processes), repeats=2))
    out.append(Step("eval", f"one example of {name}: {n}-token prompt, {len(cfg.variants)} variants — the "
                            f"question-aware prefill, window attention, full and r = {min(cfg.ratios)} caches, one "
                            "decoding step through each", _eval(cfg)))
    return out

