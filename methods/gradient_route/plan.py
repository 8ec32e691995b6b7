"""`icml gradient-route plan`: one training step of the dense baseline and of GRAM, one MaxEnt update, one
round of the relearning attack and one evaluation chunk, at the preset's sizes, on the meta device
(cli/plan.py). Training runs under torchrun: every process holds the whole model and runs each micro-batch's
route on its batch / accum / processes windows (`rank_loss`'s shard), the gradients averaged over the
processes before the group optimizers step; eval (the attack, the losses) runs in one process.

The vocabulary is the paper's 4 096 tokens (`--set tokenizer=DIR`; characters are fewer). GRAM's model has the
synthetic corpus's four auxiliary modules; its planned micro-batch is an unlabelled one, which runs and
updates every module (the largest route); with accum > 1 the step's other micro-batches run a module with the
core frozen (the functional_call path). The attack runs on GRAM's model with every module kept (profile
`all`), the largest served model. The float() of the losses and the attack's stopping rule (values) are left
out, and so is transformers' check for packed sequences in the windows' positions (it reads values; our
windows are never packed, for which it returns None): `_unpacked` stands it in by that None.
Attention runs on torch's math backend inside it (scores materialised, as the meta device does anyway; a
GPU's fused kernels need less than planned)."""
from __future__ import annotations

import contextlib

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.gradient_route import training as T
from icml.methods.gradient_route.config import AUX_TOPICS
from icml.methods.gradient_route.model import CORE, build_model

LAYOUT = "torchrun: one process per GPU, gradients averaged over the micro-batch (eval: one process)"
OVERSIZE = ["elicit.chunk=1024"]  # the paper's 512 attack windows in one forward and backward
VOCAB = 4096
PAD = 0


@contextlib.contextmanager
def _unpacked():
    from transformers import masking_utils

    from torch.nn.attention import SDPBackend, sdpa_kernel

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with sdpa_kernel(SDPBackend.MATH):  # attention's scores materialised, on meta as on the CPU
            yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def hardware(preset: str) -> Hardware:
    return Hardware(8, 80e9) if preset == "paper" else Hardware(1, 80e9)


def _model(cfg, tracker, width: int, aux):
    with torch.device(tracker.device):
        model = build_model(cfg, VOCAB, width, aux, cfg.d_aux, 0)
    return model


def _windows(cfg, n: int, tracker) -> torch.Tensor:
    return torch.randint(1, VOCAB, (max(1, n), cfg.gpt.context + 1), device=tracker.device)


def _micro(cfg, processes: int) -> int:
    return max(1, cfg.batch // cfg.accum // processes)


def _train(cfg, processes: int, routed: bool):
    def run(tracker):
        model = _model(cfg, tracker, cfg.d_core if routed else cfg.d_dense, AUX_TOPICS if routed else [])
        optimizers = T.GroupOptimizers(model, cfg)
        tracker.watch(model, *optimizers.optimizers.values())
        if routed:
            everything = frozenset([CORE, *AUX_TOPICS])
            step = [T.MicroBatch(_windows(cfg, _micro(cfg, processes), tracker), T.UNLABELLED, None, everything)]
            step += [T.MicroBatch(_windows(cfg, _micro(cfg, processes), tracker), AUX_TOPICS[0], {AUX_TOPICS[0]: 1.0},
                                  frozenset([AUX_TOPICS[0]]), frozenset([CORE]))] * (cfg.accum - 1)
        else:
            step = [T.MicroBatch(_windows(cfg, _micro(cfg, processes), tracker), "core", {}, frozenset([CORE]))
                    for _ in range(cfg.accum)]
        with _unpacked():
            for _ in range(2):  # the second step holds AdamW's state from its start
                T.train_step(model, optimizers, step, PAD, cfg.lr)
    return run


def _maxent(cfg, processes: int):
    def run(tracker):
        model = _model(cfg, tracker, cfg.d_dense, [])
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.maxent.lr, betas=(cfg.beta1, cfg.beta2),
                                      weight_decay=cfg.weight_decay)
        tracker.watch(model, optimizer)
        share = max(1, cfg.maxent.batch // processes)  # this process's slice of the forget and retain windows
        x_f, x_r = _windows(cfg, share, tracker), _windows(cfg, share, tracker)
        with _unpacked():
            for _ in range(2):
                T.maxent_step(model, optimizer, x_f, x_r, 15.0, PAD, cfg.clip)
    return run


def _attack(cfg):
    def run(tracker):
        model = _model(cfg, tracker, cfg.d_core, AUX_TOPICS)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr / cfg.elicit.lr_divisor,
                                      betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        tracker.watch(model, optimizer)
        attack = _windows(cfg, cfg.elicit.attack_windows, tracker)
        with _unpacked():
            for _ in range(2):
                T.attack_round(model, optimizer, attack, PAD, cfg.clip, cfg.elicit.chunk)
    return run


def _eval(cfg):
    def run(tracker):
        model = _model(cfg, tracker, cfg.d_core, AUX_TOPICS)
        tracker.watch(model)
        with _unpacked():
            T.window_losses(model, _windows(cfg, min(32, cfg.val_windows), tracker), PAD)  # window_losses' chunk
    return run


def steps(cfg, processes: int) -> list[Step]:
    micro, tokens = _micro(cfg, processes), cfg.gpt.context
    return [
        Step("train", f"baseline (MLP width {cfg.d_dense}): an AdamW step of {cfg.accum} micro-batch(es) of "
                      f"{micro} × {tokens} tokens per process", _train(cfg, processes, False), repeats=2),
        Step("train", f"GRAM (core {cfg.d_core} + {len(AUX_TOPICS)} modules of {cfg.d_aux}): a step of {cfg.accum} "
                      f"micro-batch(es) of {micro} × {tokens} tokens per process, every module run",
             _train(cfg, processes, True), repeats=2),
        Step("maxent", f"a MaxEnt update on {max(1, cfg.maxent.batch // processes)} forget + as many retain windows "
                       "per process", _maxent(cfg, processes), repeats=2),
        Step("attack", f"a relearning-attack round: one AdamW step on {cfg.elicit.attack_windows} attack windows, "
                       f"{min(cfg.elicit.chunk, cfg.elicit.attack_windows)} per forward (one process)", _attack(cfg), repeats=2),
        Step("eval", f"window losses of {min(32, cfg.val_windows)} validation windows, every module",
             _eval(cfg)),
    ]
