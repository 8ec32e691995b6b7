"""`icml spectral-optim plan`: a training step of every variant's optimizer and a validation forward, at the
preset's sizes, on the meta device (cli/plan.py). A grid run is one process on one GPU (under torchrun: DDP
over its ranks, each on batch_size / processes windows of the global batch), holding the whole model.

The model: the preset's GPT-2 shape with GPT-2's own 50 257-token vocabulary, the paper's (OpenWebText with
GPT-2's tokenizer); a `--data` corpus read by characters has a vocabulary of a few hundred, so this bounds it.
A step is `accumulate_gradients` (micro_batch windows per forward and backward) then gradient clipping and
the optimizer step. The plan runs ONE micro-batch of a step (at 480 windows a step has 15 of 32, alike in
memory; each costs the same FLOPs), with the gradients of the step's earlier micro-batches already live, as
every micro-batch after the first holds them: FLOPs are one micro-batch's forward and backward plus the
whole optimizer step. The coupled Newton iteration (p = ½, ¼) runs all its ns_iters steps
(`psi.all_iterations`): its early stop reads values, which the meta device has not. Attention is planned on torch's math backend (scores materialised, as the
meta device does anyway; the CPU's flash kernel holds less): a GPU's fused kernels need less than planned."""
from __future__ import annotations

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from icml.cli.plan import Hardware, Step
from icml.methods.spectral_optim.lm import RunSettings, accumulate_gradients, build_optimizer, mean_loss
from icml.methods.spectral_optim.model import tiny_gpt2
from icml.methods.spectral_optim.psi import all_iterations

LAYOUT = "one process and one GPU per grid run (variant × LR); under torchrun a run is DDP over the batch"
OVERSIZE = ["micro_batch=480"]  # the paper's whole step in one forward and backward
VOCAB = 50257  # GPT-2's tokenizer (the paper's); a character vocabulary is smaller


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _model(cfg, tracker):
    with torch.device(tracker.device):
        model = tiny_gpt2(cfg.gpt.n_embd, cfg.gpt.n_layer, cfg.gpt.n_head, cfg.gpt.n_positions, VOCAB, 0)
    return model


def _windows(cfg, processes: int) -> int:
    """Windows per forward in one process: its share of the batch, micro_batch at most."""
    share = max(1, cfg.batch_size // processes)
    return min(share, cfg.micro_batch) if cfg.micro_batch else share


def _train(cfg, variant: str, processes: int):
    def run(tracker):
        model = _model(cfg, tracker).train()
        optimizer = build_optimizer(cfg, RunSettings.of(cfg, variant, cfg.lr_multipliers[0]), model)
        tracker.watch(model, optimizer)
        trainable = [param for param in model.parameters() if param.requires_grad]
        windows = torch.randint(VOCAB, (_windows(cfg, processes), cfg.block_size + 1), device=tracker.device)
        optimizer.zero_grad(set_to_none=True)
        with all_iterations(), sdpa_kernel(SDPBackend.MATH):  # MATH: module docstring
            for _ in range(2):  # the second step holds the optimizer's state and the earlier micro-batches'
                # gradients from its start. train_one's loss and gradient-norm checks (.item()) are left out
                accumulate_gradients(model, windows, cfg.micro_batch)
                torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
                optimizer.step()
    return run


def _eval(cfg, processes: int):
    def run(tracker):
        model = _model(cfg, tracker).eval()
        tracker.watch(model)
        windows = torch.randint(VOCAB, (_windows(cfg, processes), cfg.block_size + 1), device=tracker.device)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # final_val_loss's forward of one micro-batch; its .item() is left out
            mean_loss(model, windows, cfg.micro_batch)
    return run


def steps(cfg, processes: int) -> list[Step]:
    windows = _windows(cfg, processes)
    share = max(1, cfg.batch_size // processes)
    parts = -(-share // windows)
    out = [Step("train", f"{variant}: one micro-batch of {windows} × {cfg.block_size} tokens (1 of {parts} per step "
                         f"of {share} windows per process) and {variant}'s optimizer step",
                _train(cfg, variant, processes), repeats=2)
           for variant in cfg.variants]
    out.append(Step("eval", f"validation forward of {windows} × {cfg.block_size} tokens (1 of {parts} per batch)",
                    _eval(cfg, processes)))
    return out
