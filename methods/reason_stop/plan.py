"""`icml reason-stop plan`: one problem's decoding (and, for the tiny model, one training micro-batch) on the meta
device (cli/plan.py).

The model: `--set model=DIR` (its config.json, headers only, through cli/checkpoints.py), else `plan_model`
(paper: Qwen3-8B's published sizes, built from a Qwen3Config, never downloaded), float32 and eager attention as
the run loads it. The evaluation step is a Session's (controller.py): the prompt's prefill, then one decoding
step with the DynamicCache at its longest — prompt + thinking budget + a probe + the answer budget — with the
AttentionRecorder's hooks on the last n_last_layers. The controller's decisions (probe confidence, ΔH, trap
test, sampling) read values on the host one token at a time: they are left out, and so is the commit of the
recorder's rows (host lists of a few floats per token)."""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step, lm_config
from icml.methods.reason_stop.controller import AttentionRecorder, Session

LAYOUT = "one process, one GPU (variants in `workers` processes, each with its own model)"
OVERSIZE = ["max_new_tokens=262144"]
PROMPT_TOKENS = 512  # a competition-math question in a chat template

def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _config(cfg):
    """The transformers config the plan sizes; None: the tiny model."""
    if not cfg.model and cfg.plan_model == "tiny":
        return None
    return lm_config(cfg.model, cfg.plan_model)


def _tiny(cfg, tracker):
    from icml.methods.reason_stop.data import build_tokenizer
    from icml.methods.reason_stop.model import tiny_model

    tokenizer = build_tokenizer()
    with torch.device(tracker.device):
        model = tiny_model(cfg, len(tokenizer), 0)
    return model, tokenizer


def _model(cfg, tracker):
    from transformers import AutoModelForCausalLM

    config = _config(cfg)
    if config is None:
        model, tokenizer = _tiny(cfg, tracker)
        model.config._attn_implementation = "eager"  # as the saved model loads
        return model, len(tokenizer)
    with torch.device(tracker.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model, config.vocab_size


def _length(cfg) -> tuple[int, int]:
    """(prompt tokens, the cache's longest): prompt, thinking budget, a probe (its string and answer) and the
    answer budget after the exit suffix."""
    prompt = PROMPT_TOKENS if (cfg.model or cfg.plan_model != "tiny") else cfg.tiny.max_position // 4
    return prompt, prompt + cfg.max_new_tokens + 32 + cfg.probe_max_tokens + cfg.answer_max_tokens


def _eval(cfg):
    def run(tracker):
        model, vocab = _model(cfg, tracker)
        model.eval()
        tracker.watch(model)
        recorder = AttentionRecorder(model, cfg.n_last_layers)
        session = Session(model, recorder, tracker.device)
        prompt, longest = _length(cfg)
        session.forward([i % vocab for i in range(prompt)])  # the prefill
        recorder.discard()
        config = model.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        with torch.no_grad(), tracker.buffers():  # the thinking so far: the cache at its longest but one
            for layer in range(config.num_hidden_layers):
                grown = torch.zeros(1, heads, longest - 1 - prompt, head_dim, device=tracker.device)
                session.cache.update(grown, grown.clone(), layer)
                del grown
        session.forward([0])  # one decoding step, its attention rows recorded
        tracker.buffer(*(layer.keys for layer in session.cache.layers), *(layer.values for layer in session.cache.layers))
        recorder.discard()
        recorder.remove()
    return run


def _train(cfg, processes: int):
    from icml.methods.reason_stop.model import micro_batch_backward

    def run(tracker):
        model, _ = _tiny(cfg, tracker)
        # training runs SDPA: a fused kernel on CUDA and CPU, its math decomposition on meta; eager attention holds
        # the same scores on every device, so the plan (an upper bound of SDPA's) is the CPU run's to the byte
        model.config._attn_implementation = "eager"
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        tracker.watch(model, optimizer)
        rows = min(cfg.train_micro_batch, cfg.batch_size)
        batch = {"input_ids": torch.zeros(rows, cfg.max_length, dtype=torch.long, device=tracker.device),
                 "labels": torch.zeros(rows, cfg.max_length, dtype=torch.long, device=tracker.device)}
        for _ in range(2):  # the second step holds AdamW's state from its start
            optimizer.zero_grad(set_to_none=True)
            micro_batch_backward(model, batch, rows * cfg.max_length)  # the longest micro-batch of a step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    return run


def steps(cfg, processes: int) -> list[Step]:
    prompt, longest = _length(cfg)
    name = cfg.model or (cfg.plan_model if cfg.plan_model != "tiny" else "the tiny Llama")
    out = []
    if not (cfg.model or cfg.plan_model != "tiny"):  # with --model nothing is trained
        out.append(Step("train", f"an AdamW step of the tiny Llama, its longest micro-batch "
                                 f"({min(cfg.train_micro_batch, cfg.batch_size)} × {cfg.max_length} tokens)",
                        _train(cfg, processes), repeats=2))
    out.append(Step("eval", f"one problem on {name}: a {prompt}-token prefill, then one decoding step with the cache "
                            f"at {longest} tokens (thinking budget {cfg.max_new_tokens})", _eval(cfg)))
    return out
