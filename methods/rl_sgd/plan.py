"""`icml rl-sgd plan`: one rollout, one GRPO update and one greedy-accuracy chunk, on the meta device (cli/plan.py).

The policy: `--set model=DIR` (its config.json, headers only, through cli/checkpoints.py), else `plan_model`
(paper: Qwen3-8B's published sizes, built from a Qwen3Config, never downloaded), fp32 master weights as
load_policy makes them. Sampling (model.generate) is data-dependent (multinomial, "all finished?"): a rollout
is planned as its prefill plus one decoding step with the KV cache at full length (prompt + max_new_tokens),
for every completion (each process samples the whole rollout, runs.py). The update is `surrogate_step` on this
process's share of the P·G completions (grpo.rank_share), at full length, with the largest optimizer state of
the configured arms (AdamW's when it is one of them); its two optimizer steps hold that state from the second."""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step, lm_config
from icml.methods.rl_sgd.model import Prompts, _positions

LAYOUT = "torchrun: one process per GPU, DDP over the completions (every process samples the whole rollout)"
# An 8B policy in fp32 with AdamW holds 32.8 GB of weights, 32.8 GB of gradients and 65.5 GB of moments on every
# process, and the update's log-probs of 128 completions × 1 280 tokens per process hold [128, 1 280, 151 936]
# fp32 logits (100 GB) at once: it needs sharded state (FSDP / ZeRO-3), micro-batches and a smaller rollout
# batch per forward, none of which rl-sgd has (README, paper preset).
DOES_NOT_FIT = "fp32 8B policy + AdamW replicated per process and the whole share's logits at once: see the README"
OVERSIZE = ["max_new_tokens=4096"]
PROMPT_TOKENS = 256  # a math problem in a chat template
ARM_ORDER = ("adamw", "sft_adamw", "adam_nomomentum", "rmsprop", "muon", "sgd_momentum", "sgd", "sft_sgd",
             "sgd_bf16_master")  # the largest optimizer state first

def hardware(preset: str) -> Hardware:
    return Hardware(8, 80e9) if preset == "paper" else Hardware(1, 80e9)


def _sized(cfg) -> bool:
    return bool(cfg.model) or cfg.plan_model != "tiny"


def _model(cfg, tracker):
    model, vocab = _policy(cfg, tracker)
    # the policy runs SDPA: a fused kernel on CUDA and CPU, its math decomposition on meta; eager attention holds
    # the same scores on every device, so the plan (an upper bound of SDPA's) is the CPU run's to the byte
    model.config._attn_implementation = "eager"
    return model, vocab


def _policy(cfg, tracker):
    from transformers import AutoModelForCausalLM

    if cfg.model or cfg.plan_model != "tiny":
        config = lm_config(cfg.model, cfg.plan_model)
    else:
        from icml.methods.rl_sgd import task as tasks
        from icml.methods.rl_sgd.model import tiny_llama

        tokenizer = tasks.build_tokenizer()
        specials = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                    "pad_token_id": tokenizer.pad_token_id}
        m = cfg.llama
        with torch.device(tracker.device):
            model = tiny_llama(len(tokenizer), m.hidden, m.layers, m.heads, m.kv_heads, m.intermediate,
                               m.max_position, specials, init_seed=0)
        return model, len(tokenizer)
    with torch.device(tracker.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, config.vocab_size


def _prompt_tokens(cfg) -> int:
    return PROMPT_TOKENS if _sized(cfg) else 8  # the tiny task: "123 + 456 =" in its word tokenizer


def _materialised_masks():
    """transformers reads the padding mask's values to decide whether SDPA may skip it (`is_causal`); values a
    meta tensor does not have. The plan answers "padding present" (left-padded batches: the mask is built)."""
    from unittest import mock

    return mock.patch("transformers.masking_utils._ignore_causal_mask_sdpa", lambda *args, **kwargs: False)


def _prompts(rows: int, width: int, vocab: int, device) -> Prompts:
    return Prompts(torch.randint(vocab, (rows, width), device=device),
                   torch.ones(rows, width, dtype=torch.long, device=device))


def _generation(cfg, rows: int):
    """generate()'s prefill (logits of the last column) and one step with the cache at full length."""
    def run(tracker):
        model, vocab = _model(cfg, tracker)
        model.eval()
        tracker.watch(model)
        width = _prompt_tokens(cfg)
        prompts = _prompts(rows, width, vocab, tracker.device)
        with torch.no_grad(), _materialised_masks():
            out = model(input_ids=prompts.ids, attention_mask=prompts.mask, position_ids=_positions(prompts.mask),
                        use_cache=True, logits_to_keep=1)
            cache = out.cache
            config = model.config
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            with tracker.buffers():  # the completions so far: the cache at its longest but one
                for layer in range(config.num_hidden_layers):
                    grown = torch.zeros(rows, config.num_key_value_heads, cfg.max_new_tokens - 1, head_dim,
                                        device=tracker.device)
                    cache.update(grown, grown.clone(), layer)
                    del grown
            mask = torch.ones(rows, width + cfg.max_new_tokens, dtype=torch.long, device=tracker.device)
            token = torch.zeros(rows, 1, dtype=torch.long, device=tracker.device)
            out = model(input_ids=token, attention_mask=mask, position_ids=_positions(mask)[:, -1:], cache=cache,
                        use_cache=True)
            torch.softmax(out.logits[:, -1].float() / cfg.temperature, dim=-1)  # the sampling distribution
            tracker.buffer(*(layer.keys for layer in cache.layers), *(layer.values for layer in cache.layers))
    return run


def _arm(cfg) -> str:
    return next(arm for arm in ARM_ORDER if arm in cfg.arms)


def _update(cfg, processes: int):
    from icml.methods.rl_sgd.grpo import build_optimizer, surrogate_step

    def run(tracker):
        arm = _arm(cfg)
        model, vocab = _model(cfg, tracker)
        if arm == "sgd_bf16_master":
            model = model.to(torch.bfloat16)
        model.train()
        optimizer = build_optimizer(arm, model, getattr(cfg.grids, arm)[0])
        tracker.watch(model, optimizer)
        sft = arm.startswith("sft_")
        total = cfg.sft_batch if sft else cfg.prompts_per_step * cfg.group_size
        rows = -(-total // processes)  # this process's share (grpo.rank_share)
        width = _prompt_tokens(cfg)
        prompts = _prompts(rows, width, vocab, tracker.device)
        tokens = torch.randint(vocab, (rows, cfg.max_new_tokens), device=tracker.device)
        mask = torch.ones(rows, cfg.max_new_tokens, dtype=torch.long, device=tracker.device)
        adv = torch.zeros(rows, device=tracker.device, dtype=next(model.parameters()).dtype)
        for _ in range(2):  # the second step holds the optimizer's state from its start
            with _materialised_masks():
                surrogate_step(model, optimizer, prompts, tokens, mask, adv, mask, float(total * cfg.max_new_tokens),
                               None, cfg.clip_eps, cfg.grad_clip, cfg.temperature)
    return run


def steps(cfg, processes: int) -> list[Step]:
    from icml.methods.rl_sgd.runs import EVAL_CHUNK

    name = cfg.model or (cfg.plan_model if cfg.plan_model != "tiny" else "the tiny Llama")
    rollout = cfg.prompts_per_step * cfg.group_size
    share = -(-(cfg.sft_batch if _arm(cfg).startswith("sft_") else rollout) // processes)
    length = f"{_prompt_tokens(cfg)} + {cfg.max_new_tokens} tokens"
    chunk = min(EVAL_CHUNK, cfg.eval_problems)
    return [Step("rollout", f"{name}: {rollout} completions ({cfg.prompts_per_step} prompts × {cfg.group_size}), "
                            f"prefill + one decoding step with the cache at {length}", _generation(cfg, rollout)),
            Step("train", f"{name}: one {_arm(cfg)} update on this process's {share} completions of {length}",
                 _update(cfg, processes), repeats=2),
            Step("eval", f"{name}: greedy accuracy, a chunk of {chunk} prompts, prefill + one decoding step at "
                         f"{length}", _generation(cfg, chunk))]
