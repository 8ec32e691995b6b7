"""`icml explain-vit` train and eval.

train: generate the synthetic objects-on-clutter data, train the toy ViTForImageClassification, save it with
save_pretrained (an external `--model` checkpoint is only checked and scored). eval: select confidently correct
test images (and montages of confident cells), pick α_max by GridPG on validation montages, explain with every
arm, and record localisation, faithfulness, stability, lattice-artefact, class-sensitivity and cost metrics.
"""
from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from icml.cli.errors import UsageError
from icml.cli.threads import SMALL_ARRAY_ENTRIES, intra_op_threads, single_thread
from icml.methods.explain_vit import attribution as attr
from icml.methods.explain_vit import metrics as M
from icml.methods.explain_vit.attribution import FAMILY
from icml.methods.explain_vit.config import FASHION_MNIST_DIR, ExplainVitConfig
from icml.methods.explain_vit.data import ImageSet, MontageSet, fashion_mnist, load_folder, make_montages, synthetic
from icml.methods.explain_vit.model import Classifier, build_toy, load, save, train_classifier

BATCH = 16  # images explained together
TRAIN_THREADS = 2  # at most, for large training batches


def model_path(ctx) -> Path:
    return Path(ctx.config.model) if ctx.config.model else ctx.run.checkpoints / "model"


def model_tag(cfg: ExplainVitConfig) -> str:
    return Path(cfg.model).name if cfg.model else "toy_vit"


def open_classifier(path: str | Path, device: str) -> Classifier:
    try:
        return load(path, device)
    except ValueError as exc:
        raise UsageError(str(exc), "pass a ViTForImageClassification directory saved with save_pretrained") from None


@lru_cache(maxsize=1)  # train reads train + val, eval test, val and montage cells: one load and split per process
def _fashion(path: str, seed: int, n_train: int, n_val: int, n_test: int, foreground: float) -> dict[str, ImageSet]:
    return fashion_mnist(None if path == FASHION_MNIST_DIR else path, seed, n_train, n_val, n_test, foreground)


def _data(cfg: ExplainVitConfig, seed: int, classifier: Classifier | None, split: str, n: int,
          offset: int = 0) -> ImageSet:
    if cfg.data_cfg.dataset == "fashion_mnist":  # the real preset: split is train, val, test or montage
        d = cfg.data_cfg
        return _fashion(cfg.data, seed, d.n_train, d.n_val, d.n_test, d.foreground)[split]
    if cfg.data == "synthetic":
        return synthetic(seed, split, n, cfg.data_cfg.image_size, offset)
    try:
        return load_folder(cfg.data, classifier.size, classifier.classes)
    except ValueError as exc:
        raise UsageError(str(exc), "fix the folder (images, <stem>_mask.png, labels.csv: file,label[,x0,y0,x1,y1])") \
            from None


def _tensor(a: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


# train -------------------------------------------------------------------------------------------
def train(ctx) -> None:
    cfg, device = ctx.config, ctx.device
    # two intra-op threads (never more than the process was given: OMP_NUM_THREADS=1 keeps training on one core) only
    # where the largest training activation, batch × tokens × MLP width, has ≥ 1M entries (the default's 3.2M); below,
    # one (smoke's and real's 0.8M: smoke's 32 steps took 2.5 s each with two threads on a busy 2-core machine, 80 of
    # its 149 s; cli/threads.py)
    tokens = (cfg.data_cfg.image_size // cfg.vit.patch_size) ** 2 + 1
    large = cfg.train.batch_size * tokens * cfg.vit.intermediate_size >= SMALL_ARRAY_ENTRIES
    with intra_op_threads(min(TRAIN_THREADS, torch.get_num_threads()) if large else 1):
        if cfg.model:
            classifier = open_classifier(cfg.model, device)
            if cfg.data == "synthetic" and classifier.classes != [str(c) for c in _synthetic_classes()]:
                ctx.log("the external model's classes are not the synthetic ones: accuracy is not scored")
                return
            test = _data(cfg, ctx.seed, classifier, "test", cfg.data_cfg.n_test)
            known = test.labels >= 0
            if known.any():
                probs = classifier.predict(classifier.normalise(_tensor(test.images[known], device)))
                acc = float((probs.argmax(-1).cpu().numpy() == test.labels[known]).mean())
                ctx.record([{"variant": "model", "metric": "accuracy", "value": acc, "model": model_tag(cfg)}],
                           split="test")
            return
        train_set = _data(cfg, ctx.seed, None, "train", cfg.data_cfg.n_train)
        val = _data(cfg, ctx.seed, None, "val", cfg.data_cfg.n_val)
        classes = _classes(cfg)
        model = build_toy(cfg, ctx.seed, classes).to(device)
        classifier = Classifier(model, torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.5),
                                cfg.data_cfg.image_size, cfg.vit.patch_size, classes)
        steps = -(-cfg.data_cfg.n_train // cfg.train.batch_size) * cfg.train.epochs
        tag = model_tag(cfg)

        def on_epoch(epoch, loss, acc):
            val_probs = classifier.predict(classifier.normalise(_tensor(val.images, device)))
            val_acc = float((val_probs.argmax(-1).cpu().numpy() == val.labels).mean())
            classifier.model.train()
            ctx.record([{"variant": "model", "metric": "loss", "value": loss, "step": epoch + 1, "model": tag},
                        {"variant": "model", "metric": "accuracy", "value": acc, "step": epoch + 1, "model": tag}],
                       split="train")
            ctx.record([{"variant": "model", "metric": "accuracy", "value": val_acc, "step": epoch + 1,
                         "model": tag}], split="val")
            ctx.log(f"epoch {epoch + 1}: loss {loss:.4f} · train acc {acc:.3f} · val acc {val_acc:.3f}")

        with ctx.progress("training the toy ViT", steps) as advance:
            train_classifier(classifier, train_set.images, train_set.labels, cfg, ctx.seed, device, on_epoch, advance)
        if cfg.data_cfg.dataset == "fashion_mnist":  # the classifier's test accuracy on all 10,000 t10k images
            images = [_data(cfg, ctx.seed, None, part, 0) for part in ("test", "montage")]
            probs = classifier.predict(classifier.normalise(_tensor(np.concatenate([s.images for s in images]), device)))
            labels = np.concatenate([s.labels for s in images])
            acc = float((probs.argmax(-1).cpu().numpy() == labels).mean())
            ctx.record([{"variant": "model", "metric": "accuracy", "value": acc, "step": cfg.train.epochs,
                         "model": tag}], split="test")
            ctx.log(f"test accuracy (t10k, {len(labels)} images): {acc:.4f}")
        save(classifier.model.cpu(), ctx.checkpoints / "model")


def _synthetic_classes() -> list[str]:
    from icml.methods.explain_vit.data import CLASSES

    return list(CLASSES)


def _classes(cfg: ExplainVitConfig) -> list[str]:
    """The toy model's classes: Fashion-MNIST's ten, or the six synthetic shapes."""
    if cfg.data_cfg.dataset == "fashion_mnist":
        from icml.data.idx import CLASSES

        return list(CLASSES)
    return _synthetic_classes()


# eval --------------------------------------------------------------------------------------------
def confident(classifier: Classifier, images: np.ndarray, labels: np.ndarray, min_conf: float, device: str,
              require_correct: bool = True):
    """Indices of correct predictions with target probability ≥ min_conf (the official benchmark's filter)."""
    if len(images) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    probs = classifier.predict(classifier.normalise(_tensor(images, device))).cpu().numpy()
    pred = probs.argmax(1)
    conf = probs[np.arange(len(labels)), np.clip(labels, 0, None)]
    keep = ((pred == labels) | (not require_correct)) & (conf >= min_conf) & (labels >= 0)
    return np.nonzero(keep)[0], conf


def _groups(arms: list[str]) -> list[list[str]]:
    """Arms computed together: the DAVE family shares one set of samples; every other arm alone."""
    family = [a for a in arms if a in FAMILY]
    return [[a] for a in arms if a not in FAMILY] + ([family] if family else [])


class Explainer:
    """Every arm on batches of normalised inputs, with its wall time and backward passes per image."""

    def __init__(self, classifier: Classifier, cfg: ExplainVitConfig, alpha_max: float, seed: int):
        self.classifier, self.cfg, self.alpha_max = classifier, cfg, alpha_max
        self.generator = torch.Generator().manual_seed(seed)
        self.wall: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.n_backward: dict[str, int] = {}

    def __call__(self, x: torch.Tensor, targets: torch.Tensor, arms: list[str], timed: bool = False) -> dict:
        out = {}
        for group in _groups(arms):
            for start in range(0, len(x), BATCH):
                xb, tb = x[start:start + BATCH], targets[start:start + BATCH]
                began = time.perf_counter()
                maps = attr.explain(self.classifier, xb, tb, group, self.cfg.dave, self.cfg.eval, self.alpha_max,
                                    self.generator)
                spent = time.perf_counter() - began
                for arm, result in maps.items():
                    out.setdefault(arm, []).append(result.maps.detach())
                    if timed:
                        self.wall[arm] = self.wall.get(arm, 0.0) + spent
                        self.count[arm] = self.count.get(arm, 0) + len(xb)
                        self.n_backward[arm] = result.n_backward
        return {arm: torch.cat(parts) for arm, parts in out.items()}


def explain_montages(explainer: Explainer, classifier: Classifier, montages: MontageSet, arms: list[str],
                     device: str, timed: bool = False) -> dict[str, torch.Tensor]:
    """(M, 4, H, W) per arm: cell k's class as the target of the k-th map."""
    if len(montages.ids) == 0:
        return {}
    x = classifier.normalise(_tensor(montages.images, device)).repeat_interleave(4, 0)
    targets = _tensor(montages.classes.reshape(-1), device)
    maps = explainer(x, targets, arms, timed)
    return {arm: m.reshape(len(montages.ids), 4, *m.shape[-2:]) for arm, m in maps.items()}


MONTAGE_POOL_ROUNDS = 16  # at most 16 × 4·n candidate cells per montage set


def _montage_pool(cfg, seed, classifier, split, n_montages, device, tag) -> MontageSet:
    """Montages whose four cells are each confidently and correctly classified on their own.

    Synthetic cells are drawn in rounds of 4·n until 4·n of them pass the filter (each cell then used once) or
    MONTAGE_POOL_ROUNDS rounds are spent: a toy model confident on ≈ 10 % of images (issue 24) left a single round of
    4·n cells with fewer than four confident classes, so no montage at all. The first round is the earlier pool."""
    if cfg.data != "synthetic":
        cells = _data(cfg, seed, classifier, split, 0)
        keep, _ = confident(classifier, cells.images, cells.labels, cfg.eval.min_confidence, device,
                            cfg.eval.require_correct)
        return make_montages(cells.subset(keep), n_montages, seed, cfg.data_cfg.montage_mode, tag)
    chunk, start = max(24, 4 * n_montages), 10_000 if split == "val" else 0
    kept: list[ImageSet] = []
    for round_ in range(MONTAGE_POOL_ROUNDS):
        cells = synthetic(seed, split, chunk, cfg.data_cfg.image_size, offset=start + round_ * chunk)
        keep, _ = confident(classifier, cells.images, cells.labels, cfg.eval.min_confidence, device,
                            cfg.eval.require_correct)
        kept.append(cells.subset(keep))
        if sum(len(k) for k in kept) >= 4 * n_montages:
            break
    pool = ImageSet(np.concatenate([k.images for k in kept]), np.concatenate([k.labels for k in kept]),
                    np.concatenate([k.masks for k in kept]), np.concatenate([k.boxes for k in kept]),
                    [i for k in kept for i in k.ids])
    return make_montages(pool, n_montages, seed, cfg.data_cfg.montage_mode, tag)


def choose_alpha(ctx, classifier: Classifier, rows: list[dict]) -> float:
    cfg = ctx.config
    if cfg.dave.alpha_max is not None:
        return cfg.dave.alpha_max
    if not any(a in FAMILY for a in cfg.eval.arms):
        return cfg.dave.alpha_grid[0]
    val = _montage_pool(cfg, ctx.seed, classifier, "val", cfg.data_cfg.n_val_montages, ctx.device, "v")
    if len(val.ids) == 0:
        ctx.log(f"no validation montages of four confident classes: α_max = {cfg.dave.alpha_grid[0]}")
        return cfg.dave.alpha_grid[0]
    scores = {}
    with ctx.progress("α_max sweep on validation montages (GridPG)", len(cfg.dave.alpha_grid)) as advance:
        for alpha in cfg.dave.alpha_grid:
            explainer = Explainer(classifier, cfg, alpha, ctx.seed)
            maps = explain_montages(explainer, classifier, val, ["dave"], ctx.device)["dave"]
            scores[alpha] = float(M.nanmean(M.grid_pg(maps)))
            rows.append({"variant": "dave", "metric": "grid_pg", "value": scores[alpha], "alpha_max": alpha,
                         "input": "montage", "split": "val"})
            advance(1)
    best = max(scores, key=lambda a: scores[a])
    ctx.log("α_max sweep (val GridPG): " + ", ".join(f"{a}: {s:.3f}" for a, s in scores.items()) + f" → {best}")
    return best


def _mean(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    return float(M.nanmean(values)) if np.isfinite(values).any() else float("nan")


def evaluate(ctx) -> None:
    # explanation batches are small (a few hundred thousand entries per op): one intra-op thread (cli/threads.py)
    with single_thread():
        _evaluate(ctx)


def _evaluate(ctx) -> None:
    cfg, device, seed = ctx.config, ctx.device, ctx.seed
    classifier = open_classifier(model_path(ctx), device)
    classifier.model.eval()
    arms, tag = list(cfg.eval.arms), model_tag(cfg)
    run_id = ctx.run.path.name
    rows: list[dict] = []
    per_image: list[dict] = []

    def add(variant, metric, values, ids=None, targets=None, **tags):
        value = _mean(values) if np.ndim(values) else float(values)
        rows.append({"variant": variant, "metric": metric, "value": value, **tags})
        if ids is not None:  # per-image rows name the non-default fill and the shift: stability_shift@2px
            name = metric + (f"@{tags['fill']}" if tags.get("fill", "blur") != "blur" else "") + \
                (f"@{tags['shift_px']}px" if "shift_px" in tags else "")
            for i, v in zip(ids, np.atleast_1d(values)):
                per_image.append({"run_id": run_id, "variant": variant, "image_id": i[0], "target": int(i[1]),
                                  "metric": name, "value": float(v)})

    alpha = choose_alpha(ctx, classifier, rows)
    common = {"model": tag, "n_samples": cfg.dave.n_samples, "alpha_max": float(alpha)}

    # single images: confidently correct test predictions
    test = _data(cfg, seed, classifier, "test", cfg.data_cfg.n_test)
    keep, _ = confident(classifier, test.images, test.labels, cfg.eval.min_confidence, device,
                        cfg.eval.require_correct)
    # what the model is confident on decides what can be measured: a montage needs four confident classes.
    # Every class of a small label set (its zeros are the finding); of a large one (ImageNet) those present
    counts = np.bincount(test.labels[keep], minlength=len(classifier.classes))
    for k, name in enumerate(classifier.classes):
        if len(classifier.classes) > 32 and counts[k] == 0:
            continue
        rows.append({"variant": "classifier", "metric": "n_confident", "value": float(counts[k]),
                     "class_name": name, "model": tag})
    test = test.subset(keep[: cfg.eval.n_test_images])
    ctx.log(f"{len(keep)} confident correct test images; explaining {len(test)} with {len(arms)} arms "
            f"(N = {cfg.dave.n_samples}, α_max = {alpha})")
    explainer = Explainer(classifier, cfg, alpha, seed)
    gallery: dict[str, np.ndarray] = {}
    if len(test):
        pixels = _tensor(test.images, device)
        x = classifier.normalise(pixels)
        targets = _tensor(test.labels, device)
        keys = list(zip(test.ids, test.labels))
        with ctx.progress("explaining test images", len(arms)) as advance:
            maps = {}
            for group in _groups(arms):
                maps.update(explainer(x, targets, group, timed=True))
                advance(len(group))
        single = {**common, "input": "single"}
        for arm in arms:
            m = maps[arm]
            if test.boxes is not None:
                add(arm, "energy_pg", M.energy_pg(m, test.boxes), keys, **single)
            if test.masks is not None:
                add(arm, "pointing_game", M.pointing_game(m, test.masks), keys, **single)
                add(arm, "pixel_auroc", M.pixel_auroc(m, test.masks), keys, **single)
            add(arm, "lattice_energy", M.lattice_energy(m, classifier.patch), keys, **single)
            add(arm, "lattice_grad_ratio", M.lattice_grad_ratio(m, classifier.patch), keys, **single)
            add(arm, "wall_s_per_image", explainer.wall[arm] / explainer.count[arm], **single)
            add(arm, "n_backward", explainer.n_backward[arm], **single)
        shown = min(cfg.eval.gallery, len(test))
        gallery["single_pixels"] = test.images[:shown]
        gallery["single_masks"] = test.masks[:shown] if test.masks is not None else np.zeros((0,))
        for arm in arms:
            gallery[f"single/{arm}"] = maps[arm][:shown].cpu().numpy()
        spectra = [{"variant": arm, "bin": b, "log_power": float(v)}
                   for arm in arms for b, v in enumerate(M.mean_log_spectrum(maps[arm]))]
        ctx.write_table("spectra", pd.DataFrame(spectra))
        _identities(ctx, classifier, x[: min(32, len(x))], targets[: min(32, len(x))], add, single)
        curves = _faithfulness(ctx, classifier, x, targets, maps, keys, add, single)
        ctx.write_table("curves", pd.DataFrame(curves))
        _stability(ctx, classifier, explainer, pixels, targets, maps, keys, add, single)

    # montages: GridPG and class sensitivity
    montages = _montage_pool(cfg, seed, classifier, "montage", cfg.data_cfg.n_montages, device, "m")
    ctx.log(f"{len(montages.ids)} montages of four confident cells")
    rows.append({"variant": "classifier", "metric": "n_montages", "value": float(len(montages.ids)), "model": tag})
    if len(montages.ids):
        with ctx.progress("explaining montages", 1) as advance:
            mmaps = explain_montages(explainer, classifier, montages, arms, device)
            advance(1)
        montage = {**common, "input": "montage"}
        for arm in arms:
            keys = [(i, -1) for i in montages.ids]
            add(arm, "grid_pg", M.grid_pg(mmaps[arm]), keys, **montage)
            pairs = [M.pearson(mmaps[arm][:, a], mmaps[arm][:, b]) for a in range(4) for b in range(a + 1, 4)]
            add(arm, "class_sensitivity", M.nanmean(np.stack(pairs, 1), 1), keys, **montage)
        shown = min(cfg.eval.gallery, len(montages.ids))
        gallery["montage_pixels"] = montages.images[:shown]
        gallery["montage_classes"] = montages.classes[:shown]
        for arm in arms:
            gallery[f"montage/{arm}"] = mmaps[arm][:shown].cpu().numpy()
    np.savez_compressed(ctx.run.path / "gallery.npz", **gallery)
    (ctx.run.path / "gallery.json").write_text(json.dumps({"classes": classifier.classes, "arms": arms}))
    ctx.record([{"step": 0, **r} for r in rows if r.get("split") != "val"], split="test")
    ctx.record([{k: v for k, v in r.items() if k != "split"} for r in rows if r.get("split") == "val"], split="val")
    ctx.write_table("per_image", pd.DataFrame(per_image, columns=["run_id", "variant", "image_id", "target", "metric",
                                                                  "value"]))


def _identities(ctx, classifier, x, targets, add, tags) -> None:
    """completeness_gap of W_eff⊙x on a bias-zeroed copy (and of ∇⊙x beside it); opvar_ratio on the model."""
    from icml.methods.explain_vit.effective import zero_biases

    twin = Classifier(zero_biases(classifier.model), classifier.mean, classifier.std, classifier.size,
                      classifier.patch, classifier.classes)
    z = twin.logits(x).gather(1, targets[:, None])[:, 0].detach()
    for arm, grad in (("weff", attr.effective_gradient(twin, x, targets)), ("input_x_grad", attr.input_gradient(twin, x, targets))):
        gap = ((grad * x).flatten(1).sum(1) - z).abs() / z.abs().clamp(min=1e-12)
        add(arm, "completeness_gap", gap.detach().cpu().numpy(), **tags)
    g, w = attr.input_gradient(classifier, x, targets), attr.effective_gradient(classifier, x, targets)
    ratio = (g - w).flatten(1).norm(dim=1) / g.flatten(1).norm(dim=1).clamp(min=1e-30)
    add("weff", "opvar_ratio", ratio.cpu().numpy(), **tags)


def _faithfulness(ctx, classifier, x, targets, maps, keys, add, tags) -> list[dict]:
    cfg = ctx.config.eval
    n = min(cfg.deletion_images, len(x))
    if n == 0:
        return []
    generator = torch.Generator().manual_seed(ctx.seed + 1)
    fills = {"blur": M.blurred(x[:n], cfg.blur_kernel, cfg.blur_sigma), "constant": torch.zeros_like(x[:n])}
    fracs = np.linspace(0, cfg.deletion_max_frac, cfg.deletion_steps + 1)
    curves = []
    jobs = [(arm, fill, mode) for arm in maps for fill in cfg.fills for mode in ("lerf", "morf", "insertion")]
    with ctx.progress("deletion and insertion curves", len(jobs)) as advance:
        for arm, fill, mode in jobs:
            c = M.perturbation_curves(classifier, x[:n], targets[:n], maps[arm][:n], fills[fill], mode,
                                      cfg.deletion_steps, cfg.deletion_max_frac, generator)
            auc = M.curve_auc(c, cfg.deletion_max_frac)
            if mode == "insertion":
                add(arm, "insertion_auc", auc, keys[:n], fill=fill, **tags)
            else:
                add(arm, f"deletion_{mode}_auc", auc, keys[:n], direction=mode, fill=fill, **tags)
            curves += [{"variant": arm, "mode": mode, "fill": fill, "frac": float(f), "prob": float(p)}
                       for f, p in zip(fracs, c.mean(0))]
            advance(1)
    return curves


def _stability(ctx, classifier, explainer, pixels, targets, maps, keys, add, tags) -> None:
    cfg = ctx.config.eval
    n = min(cfg.stability_images, len(pixels))
    if n == 0:
        return
    generator = torch.Generator().manual_seed(ctx.seed + 2)
    arms = list(maps)
    noisy = pixels[:n] + cfg.stability_noise_sd * torch.randn(pixels[:n].shape, generator=generator).to(pixels)
    with ctx.progress("stability under noise and shifts", 1 + len(cfg.shifts)) as advance:
        noisy_maps = explainer(classifier.normalise(noisy), targets[:n], arms)
        for arm in arms:
            add(arm, "stability_noise", M.pearson(maps[arm][:n], noisy_maps[arm]), keys[:n], **tags)
        advance(1)
        for k in cfg.shifts:
            shifted = explainer(classifier.normalise(M.shift_image(pixels[:n], k)), targets[:n], arms)
            for arm in arms:
                a, b = M.shift_overlap(shifted[arm], maps[arm][:n], k)
                add(arm, "stability_shift", M.pearson(a, b), keys[:n], shift_px=k, **tags)
            advance(1)


# the explain verb --------------------------------------------------------------------------------
def _run_alpha(run) -> float | None:
    """The α_max a run's eval chose (its eval rows carry it), if any."""
    if run is None or not run.metrics_path.exists():
        return None
    frame = pd.read_parquet(run.metrics_path)
    rows = frame[(frame["phase"] == "eval") & (frame["split"] == "test")]["alpha_max"].dropna()
    return float(rows.iloc[0]) if len(rows) else None


def explain_files(model_dir: Path, cfg: ExplainVitConfig, run, images: list[Path], target: str | None, arm: str,
                  n: int | None, out: Path, device: str) -> dict:
    """Explain each image with one arm; writes <stem>_<arm>.npy, _heatmap.png and _overlay.png under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icml.methods.explain_vit.data import read_image, resize
    from icml.methods.explain_vit.effective import is_patched

    if n is not None:
        cfg.dave.n_samples = n
    alpha = cfg.dave.alpha_max if cfg.dave.alpha_max is not None else (_run_alpha(run) or cfg.dave.alpha_grid[0])
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with single_thread():
        classifier = open_classifier(model_dir, device)
        explainer = Explainer(classifier, cfg, alpha, 0)
        for path in images:
            try:
                pixels = resize(read_image(path), classifier.size)
            except ValueError as exc:
                raise UsageError(str(exc), "pass a readable PNG/JPEG file") from None
            x = classifier.normalise(_tensor(pixels[None], device))
            probs = classifier.predict(x)[0]
            if target is None:
                index = int(probs.argmax())
            elif target.lstrip("-").isdigit() and 0 <= int(target) < len(classifier.classes):
                index = int(target)
            elif target in classifier.classes:
                index = classifier.classes.index(target)
            else:
                raise UsageError(f"--target '{target}' is not a class of the model",
                                 f"use an index < {len(classifier.classes)} or a class name")
            m = explainer(x, torch.tensor([index], device=x.device), [arm])[arm][0].cpu().numpy()
            if is_patched(classifier.model):  # the effective mode never outlives an explanation
                raise RuntimeError("the model is still patched after explaining")
            stem = out / f"{path.stem}_{arm}"
            np.save(f"{stem}.npy", m)
            shown = m / (np.abs(m).max() + 1e-12)
            plt.imsave(f"{stem}_heatmap.png", shown, cmap="bwr" if (m < 0).any() else "inferno",
                       vmin=-1 if (m < 0).any() else 0, vmax=1)
            figure, axis = plt.subplots(figsize=(3, 3))
            axis.imshow(pixels.transpose(1, 2, 0))
            axis.imshow(np.clip(shown, 0, 1), cmap="inferno", alpha=0.55, vmin=0, vmax=1)
            axis.set_axis_off()
            figure.savefig(f"{stem}_overlay.png", dpi=110, bbox_inches="tight")
            plt.close(figure)
            results.append({"image": str(path), "target": index, "class": classifier.classes[index],
                            "probability": float(probs[index]), "npy": f"{stem}.npy", "heatmap": f"{stem}_heatmap.png",
                            "overlay": f"{stem}_overlay.png"})
    return {"method": arm, "alpha_max": alpha, "n_samples": cfg.dave.n_samples, "images": results}
