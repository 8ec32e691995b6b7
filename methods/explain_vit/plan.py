"""`icml explain-vit plan`: the toy classifier's training step (only without --model: the paper preset trains
nothing), DAVE on one batch of test images and one chunk of deletion/insertion curves, at the preset's sizes on
the meta device (cli/plan.py). One process, one GPU: eval puts the whole explained test set on the device
(pixels, inputs and every arm's maps), so the steps hold it too.

Left out, as they cost Python time on the meta device and hold less: the DAVE chunks after the first (at 224 px a
chunk is one row of the N × 16 rows, dave.chunk · 1024 / 224² < 1; every chunk is the same forward/backward), the
other baselines (one to 50 input gradients each, none larger than GAE's attention gradients), the stability
re-explanations (the same batches on fewer images) and the montages (224-px grids in the paper preset: the same
inputs as single images).
"""
from __future__ import annotations

import numpy as np
import torch

from icml.cli.plan import Hardware, Step
from icml.methods.explain_vit import attribution as attr
from icml.methods.explain_vit import metrics as M
from icml.methods.explain_vit.attribution import FAMILY
from icml.methods.explain_vit.data import CLASSES
from icml.methods.explain_vit.effective import effective_mode
from icml.methods.explain_vit.model import Classifier, build_toy, decay_groups, train_step
from icml.methods.explain_vit.pipeline import BATCH

LAYOUT = "one process, one GPU (no data-parallel path; seeds run side by side)"
OVERSIZE = ["eval.n_test_images=200000"]
IMAGENET_CLASSES = 1000


def hardware(preset: str) -> Hardware:
    return Hardware(1, 80e9)


def _classifier(cfg, tracker, toy: bool) -> Classifier:
    """The toy ViT (train without --model), or the explained classifier: at 224 px the paper's ViT-B/16 with
    ImageNet's 1 000 classes (a ViTConfig of its sizes, eager attention as model.load uses), else the toy."""
    from transformers import ViTConfig, ViTForImageClassification

    size = cfg.data_cfg.image_size
    with torch.device(tracker.device):
        if toy or size != 224:
            model = build_toy(cfg, 0)
        else:
            config = ViTConfig(image_size=size, patch_size=cfg.vit.patch_size, num_channels=3,
                               hidden_size=cfg.vit.hidden_size, num_hidden_layers=cfg.vit.layers,
                               num_attention_heads=cfg.vit.heads, intermediate_size=cfg.vit.intermediate_size,
                               num_labels=IMAGENET_CLASSES, attn_implementation="eager")
            model = ViTForImageClassification(config)
    classes = [str(i) for i in range(model.config.num_labels)]
    half = torch.full((1, 3, 1, 1), 0.5)  # the processor's mean and std (0.5, as ViTImageProcessor's default)
    return Classifier(model, half, half, size, cfg.vit.patch_size, classes)


def _train(cfg):
    def run(tracker):
        classifier = _classifier(cfg, tracker, toy=True)
        model = classifier.model.train()
        opt = torch.optim.AdamW(decay_groups(model, cfg.train.weight_decay), lr=cfg.train.lr)
        tracker.watch(model, opt)
        size, batch = cfg.data_cfg.image_size, cfg.train.batch_size
        pixels = torch.rand(batch, 3, size, size, device=tracker.device)
        y = torch.randint(len(CLASSES), (batch,), device=tracker.device)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # the second step holds AdamW's state from its start
            train_step(classifier, opt, pixels, y, cfg.train.lr, cfg.train.grad_clip, generator)
    return run


def _test_set(cfg, classifier, tracker, arms: list[str]):
    """What eval holds on the device while it explains: the test images' pixels and inputs, and the maps of
    `arms` (method buffers)."""
    n, size = cfg.eval.n_test_images, cfg.data_cfg.image_size
    with tracker.buffers():
        pixels = torch.rand(n, 3, size, size, device=tracker.device)
        x = classifier.normalise(pixels)
        maps = {arm: torch.rand(n, size, size, device=tracker.device) for arm in arms}
    targets = torch.randint(len(classifier.classes), (n,), device=tracker.device)
    return pixels, x, targets, maps


def _explain(cfg):
    def run(tracker):
        classifier = _classifier(cfg, tracker, toy=False)
        classifier.model.eval()
        tracker.watch(classifier.model)
        arms = list(cfg.eval.arms)
        done = [a for a in arms if a not in FAMILY]  # the DAVE family is the last group (pipeline._groups)
        _, x, targets, _ = _test_set(cfg, classifier, tracker, done)
        xb, tb = x[:BATCH], targets[:BATCH]
        generator = torch.Generator().manual_seed(0)
        dave = cfg.dave
        alpha = dave.alpha_max if dave.alpha_max is not None else max(dave.alpha_grid)
        levels = attr.noise_levels(dave.n_samples, alpha)
        rows_image, rows_sample, per_chunk = attr.sample_rows(len(xb), dave.n_samples, tuple(xb.shape[-2:]),
                                                              dave.chunk)
        with tracker.buffers():  # sampled_contributions' c: (N · B, C, H, W)
            out = torch.empty((len(rows_image),) + tuple(xb.shape[1:]), dtype=xb.dtype, device=xb.device)
        with effective_mode(classifier.model):  # its first chunk of rows: every other chunk is the same
            out[:per_chunk] = attr.contribution_chunk(classifier, xb, tb, dave, alpha, generator, levels,
                                                      rows_image[:per_chunk], rows_sample[:per_chunk])
        c = out.reshape(dave.n_samples, len(xb), *xb.shape[1:])
        robust = attr.mad_mean(c, dave.mad_k)  # weff_eq_lp, dave_nopost and dave from the same samples
        c.mean(0).sum(1), robust.sum(1), attr.postprocess(robust, dave)
        del out, c, robust
        attr.gae(classifier, xb, tb)  # the largest baseline: gradients of every layer's attention
    return run


def _curves(cfg):
    def run(tracker):
        classifier = _classifier(cfg, tracker, toy=False)
        classifier.model.eval()
        tracker.watch(classifier.model)
        e = cfg.eval
        _, x, targets, maps = _test_set(cfg, classifier, tracker, list(cfg.eval.arms))
        n = min(e.deletion_images, len(x))
        fills = {"blur": M.blurred(x[:n], e.blur_kernel, e.blur_sigma), "constant": torch.zeros_like(x[:n])}
        generator = torch.Generator().manual_seed(1)
        order = M.order_pixels(maps[e.arms[0]][:n], most_first=True, generator=generator)  # morf
        rank = M.pixel_ranks(order)
        side = x.shape[-1]
        counts = np.round(np.linspace(0, e.deletion_max_frac, e.deletion_steps + 1) * side * side).astype(int)
        chunk = slice(0, M.CURVE_IMAGES)  # perturbation_curves' first chunk of images: every chunk is the same
        M.curve_chunk(classifier, x[:n][chunk], fills[e.fills[0]][chunk], targets[:n][chunk], rank[chunk], counts)
    return run


def steps(cfg, processes: int) -> list[Step]:
    out = []
    if not cfg.model:
        out.append(Step("train", f"the toy ViT (no --model): an AdamW step on {cfg.train.batch_size} images of "
                                 f"{cfg.data_cfg.image_size} px", _train(cfg), repeats=2))
    out.append(Step("eval", f"DAVE (N = {cfg.dave.n_samples}) on {BATCH} of {cfg.eval.n_test_images} test images: "
                            "one forward/backward chunk, MAD aggregation, post-processing; GAE", _explain(cfg)))
    out.append(Step("eval", f"deletion curves: {min(M.CURVE_IMAGES, cfg.eval.deletion_images)} images × "
                            f"{cfg.eval.deletion_steps + 1} paths of {cfg.eval.deletion_images} per arm",
                    _curves(cfg)))
    return out
