"""The soup lifecycle.

train: data (clean splits, corruption suite, the unlabelled pool U) → stock θ₀ (MAE pre-training
       unless --model) → shared probe h0 → SSL ingredients on U and clean-image controls → LP-FT
       back of the stock, every ingredient, every control and the supervised-soup fine-tunes;
       every network is also saved with save_pretrained.
eval:  soups in both orders (uniform, greedy, self-seasoning, per algorithm, clean control,
       supervised), best single ingredient, ensemble, interpolation paths; every variant is scored
       on clean and every (corruption, severity) test set; metrics.parquet and interp.parquet.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

from icml.cli import distributed
from icml.cli.errors import IcmlError
from icml.cli.lifecycle import RunContext
from icml.cli.runstore import atomic_torch_save, load_checkpoint

TEST_ID_OFFSET = 1_000_000  # corruption seeds: val images are ids 0…, test images 1e6 + i
INTERP_PAIRS = (("mae_m75", "mocov3_t0.2"),)
ALPHAS = [round(0.1 * i, 1) for i in range(11)]
DIFF_INIT_SEED_OFFSET = 7919  # diff_init's stock init seed = run seed + this
KNN_SHIFT_IMAGES = 1000  # seen-type corrupted test images for an SSL encoder's shifted knn_acc
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# data ------------------------------------------------------------------------------------------------
@dataclass
class Data:
    train: object
    val: object
    test: object
    classes: list[str]
    size: int
    channels: int
    test_sets: dict = field(default_factory=dict)  # (kind, severity) -> Split of corrupted test images
    val_sets: dict = field(default_factory=dict)  # (kind, severity) -> Split of corrupted val images
    pool: object = None  # U: unlabelled shifted images
    seen: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)
    dataset: str = "digits"  # cfg.dataset: which corruption suite the types belong to

    def benchmark_of(self, kind: str) -> str:
        """digits_c | digits_lc (digits), fashion_c (fashion_mnist), or shift_data for another type (a user
        --set shift_data folder's)."""
        from icml.data import fashion_c
        from icml.data.images import benchmark_of

        if self.dataset == "fashion_mnist":
            return fashion_c.BENCHMARK if kind in fashion_c.FASHION_C else "shift_data"
        return benchmark_of(kind)


def clean_splits(cfg, seed: int, size: int, channels: int):
    """({train, val, test} Splits at the stock's size and channels, class names) of cfg.dataset."""
    import torch.nn.functional as F

    from icml.data import images as img

    if cfg.dataset == "fashion_mnist":
        from icml.data import idx

        splits = idx.fashion_mnist_splits(cfg.data, cfg.val_images, seed)
        train = splits["train"]
        if 0 < cfg.train_images < len(train):  # a seeded stratified subset of the labelled train images
            import numpy as np
            from sklearn.model_selection import train_test_split

            keep, _ = train_test_split(np.arange(len(train)), train_size=cfg.train_images,
                                       stratify=train.labels.numpy(), random_state=seed)
            splits["train"] = img.Split(train.images[np.sort(keep)], train.labels[np.sort(keep)])
        classes, native = list(idx.CLASSES), idx.SIZE
    elif cfg.data:
        return img.load_image_folder(cfg.data, size, channels, seed)
    else:
        splits, classes, native = img.digits_splits(seed), [str(d) for d in range(10)], 16
    if size != native or channels != 1:  # a --model stock with another input: resize the grey images
        for split in splits.values():
            split.images = F.interpolate(split.images, size=(size, size), mode="bilinear",
                                         align_corners=False).expand(-1, channels, -1, -1).contiguous()
    return splits, classes


def prepare_data(cfg, seed: int, size: int, channels: int) -> Data:
    """Clean splits, the corrupted val/test sets and U (labels never kept with U)."""
    import torch

    from icml.data import images as img
    from icml.methods.soup.config import corruptions_of

    try:
        splits, classes = clean_splits(cfg, seed, size, channels)
        shift = img.load_shift_folder(cfg.shift_data, size, channels, classes) if cfg.shift_data else None
    except img.ImageDataError as exc:
        raise IcmlError(str(exc)) from None
    test = splits["test"]
    test = img.Split(test.images[:cfg.eval_test], test.labels[:cfg.eval_test])
    data = Data(splits["train"], splits["val"], test, classes, size, channels, dataset=cfg.dataset)
    if shift is not None and shift.sets is not None:  # ImageNet-C layout: its types are the benchmark
        data.test_sets = dict(shift.sets)
        kinds = sorted({kind for kind, _ in shift.sets})
        data.heldout = [k for k in kinds if k in cfg.heldout]
        data.seen = [k for k in kinds if k not in cfg.heldout]
        data.pool = torch.cat([s.images for (k, sev), s in shift.sets.items()
                               if k in data.seen and sev in cfg.shift_severities])
        return data
    if cfg.dataset == "fashion_mnist":
        from icml.data.fashion_c import corrupt
    else:
        corrupt = img.corrupt
    kinds = corruptions_of(cfg)
    data.heldout = [k for k in kinds if k in cfg.heldout]
    data.seen = [k for k in kinds if k not in cfg.heldout]
    severities = sorted(set(cfg.eval_severities) | set(cfg.shift_severities))
    val = img.Split(data.val.images[:cfg.eval_val], data.val.labels[:cfg.eval_val])
    test_ids = [TEST_ID_OFFSET + i for i in range(len(test))]
    for kind in kinds:
        for severity in severities:
            data.test_sets[(kind, severity)] = img.Split(corrupt(test.images, kind, severity, seed, test_ids),
                                                         test.labels)
            if severity in cfg.eval_severities and kind in data.seen:  # the val side of the shift: seen types
                data.val_sets[(kind, severity)] = img.Split(corrupt(val.images, kind, severity, seed),
                                                            val.labels)
    if shift is not None:  # unlabelled user images are U
        data.pool = shift.pool
    else:  # the transductive protocol: seen types' corrupted test images, all listed severities
        data.pool = torch.cat([data.test_sets[(k, s)].images for k in data.seen for s in cfg.shift_severities])
    return data


# checkpoints -------------------------------------------------------------------------------------
def unit_path(ctx: RunContext, name: str) -> Path:
    return ctx.checkpoints / "units" / f"{name}.pt"


def saved(ctx: RunContext, name: str):
    """A finished unit (state dict + extras) of this run, or None: --resume skips finished units."""
    path = unit_path(ctx, name)
    return load_checkpoint(path) if path.exists() else None


def finished(ctx: RunContext, name: str):
    """`saved` as rank 0's run directory has it, on every rank: under torchrun the other ranks' run
    directory is a scratch mirror, so what --resume skips, and every unit read back (an ingredient
    to fine-tune), comes from rank 0. Without torchrun: `saved`."""
    return distributed.from_main(saved(ctx, name) if distributed.is_main() else None)


def save_unit(ctx: RunContext, name: str, payload: dict) -> None:
    if not distributed.is_main():  # under torchrun every rank holds the same weights; rank 0 writes them
        return
    path = unit_path(ctx, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(payload, path)


def _stock(ctx: RunContext, channels: int):
    """(stock model, whether it was loaded from --model)."""
    import pickle

    from safetensors import SafetensorError

    from icml.methods.soup.vit import build_stock, load_stock

    cfg = ctx.config
    if cfg.model:
        try:
            return load_stock(cfg.model), True
        except (OSError, ValueError, RuntimeError, SafetensorError, pickle.UnpicklingError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            weights = [p for p in (Path(cfg.model) / n for n in WEIGHT_FILES) if p.is_file()]
            if weights and isinstance(exc, (SafetensorError, pickle.UnpicklingError, RuntimeError)):
                raise IcmlError(f"weights file {weights[0]} is corrupt or truncated ({reason})",
                                "re-save the model with save_pretrained or copy the file again") from None
            raise IcmlError(f"model '{cfg.model}' cannot be loaded ({reason})",
                            "pass a ViTMAE or ViT checkpoint directory saved with save_pretrained") from None
    return build_stock(cfg.vit, channels, ctx.seed), False


def input_spec(ctx: RunContext) -> tuple[int, int]:
    """(image size, channels) of the stock: --model's, else the toy stock's for the data."""
    from icml.methods.soup.config import read_model_config

    cfg = ctx.config
    if cfg.model:
        config = read_model_config(cfg.model)
        size = config.get("image_size", 224)
        return (size if isinstance(size, int) else size[0]), config.get("num_channels", 3)
    from icml.methods.soup.config import channels_of

    return cfg.vit.image_size, channels_of(cfg)


def recipes_of(ctx: RunContext, stock):
    from icml.methods.soup.config import parse_ingredients
    from icml.methods.soup.vit import has_decoder

    recipes = parse_ingredients(ctx.config.ingredients)
    if not has_decoder(stock) and any(r.algo == "mae" for r in recipes):
        raise IcmlError(f"model '{ctx.config.model}' is a plain ViT (no MAE decoder), so mae ingredients cannot "
                        "be cooked", "drop mae from ingredients or pass a ViTMAE checkpoint")
    return recipes


def control_recipes(recipes):
    """One recipe per algorithm (its first), cooked on clean images for soup_clean_ssl."""
    first = {}
    for recipe in recipes:
        first.setdefault(recipe.algo, recipe)
    return list(first.values())


def _tags(**tags) -> dict:
    return {k: v for k, v in tags.items() if v is not None}


# train ---------------------------------------------------------------------------------------------------
def train(ctx: RunContext) -> None:
    from transformers.utils import logging as hf_logging

    from icml.cli.threads import single_thread
    from icml.methods.soup.soups import fine_tune, fingerprint
    from icml.methods.soup.ssl import cook
    from icml.methods.soup.vit import build_stock, encoder_of

    hf_logging.disable_progress_bar()
    cfg = ctx.config
    size, channels = input_spec(ctx)
    with single_thread():
        stock, loaded = _stock(ctx, channels)  # first: a bad --model fails before the data is built
        recipes = recipes_of(ctx, stock)
        started = time.time()
        data = prepare_data(cfg, ctx.seed, size, channels)
        ctx.log(f"data: {len(data.train)}/{len(data.val)}/{len(data.test)} clean, {len(data.test_sets)} shifted "
                f"test sets, U = {len(data.pool)} unlabelled images; {len(recipes)} ingredients")
        ctx.record([{"variant": "data", "metric": "wall_s", "value": time.time() - started, "stage": "data"}],
                   split="train")

        # θ₀ and h0 ------------------------------------------------------------------------------
        stock = pretrained_stock(ctx, data, "stock", stock, loaded)
        if distributed.is_main():
            stock.save_pretrained(ctx.checkpoints / "hf" / "stock")
        encoder = encoder_of(stock)
        head = probe_head(ctx, data, "h0", encoder)
        origin = {"stock": fingerprint(encoder.state_dict())}  # θ₀'s identity, recorded with every unit
        ft_origin = {**origin, "h0": fingerprint(head.state_dict())}

        # ingredients ------------------------------------------------------------------------------
        jobs = [(r, "shift") for r in recipes]
        if cfg.controls:
            jobs += [(r, "clean") for r in control_recipes(recipes)]
        with ctx.progress("SSL ingredients", len(jobs)) as advance:
            for index, (recipe, pool_name) in enumerate(jobs):
                name = variant_name(recipe.name, pool_name)
                if finished(ctx, "ssl_" + name) is None:
                    started = time.time()
                    pool = data.pool if pool_name == "shift" else data.train.images
                    cooked, curve = cook(recipe, stock, pool, cfg.ssl.steps, cfg.ssl.batch_size, cfg.ssl.lr,
                                         cfg.ssl.weight_decay, cfg.ssl.warmup_frac, ctx.seed * 1000 + index,
                                         ctx.device, cfg.mocov3.momentum, cfg.mocov3.symmetric,
                                         cfg.ssl.mae_augment)
                    tags = {"stage": "ssl", "algo": recipe.algo, "ingredient": recipe.name, "ssl_pool": pool_name}
                    ctx.record([{"variant": name, "metric": "ssl_loss", "value": v, "step": s, **tags}
                                for s, v in curve]
                               + [{"variant": name, "metric": "wall_s", "value": time.time() - started, **tags}],
                               split="train")
                    save_unit(ctx, "ssl_" + name, {"state": cooked.state_dict(), **origin})
                    if distributed.is_main():
                        cooked.save_pretrained(ctx.checkpoints / "hf" / ("ssl_" + name))
                advance(1)

        # fine-tune back ---------------------------------------------------------------------------------
        fts = [("stock_ft", None, cfg.ft.lr, 0, {})]
        for recipe, pool_name in jobs:
            name = variant_name(recipe.name, pool_name)
            fts.append((name, "ssl_" + name, cfg.ft.lr, 0,
                        {"algo": recipe.algo, "ingredient": recipe.name, "ssl_pool": pool_name}))
        for multiplier, seed in supervised_grid(cfg):
            if (multiplier, seed) != (1.0, 0):  # (×1, seed 0) is stock_ft itself
                fts.append((f"supervised_m{multiplier:g}_s{seed}", None, cfg.ft.lr * multiplier, seed, {}))
        with ctx.progress("fine-tune back (LP-FT from h0)", len(fts)) as advance:
            for name, source, lr, seed_offset, tags in fts:
                if finished(ctx, name) is None:
                    started = time.time()
                    start = encoder if source is None else _encoder_with(encoder, finished(ctx, source)["state"])
                    model, curve = fine_tune(start, head, data.train.images, data.train.labels, cfg.ft.steps,
                                             cfg.ft.batch_size, lr, cfg.ft.weight_decay, cfg.ft.warmup_frac,
                                             ctx.seed + seed_offset, ctx.device, augment=cfg.ft.augment)
                    rows = [{"variant": name, "metric": "ft_loss", "value": v, "step": s, "stage": "ft", **tags}
                            for s, v in curve]
                    rows.append({"variant": name, "metric": "wall_s", "value": time.time() - started, "stage": "ft",
                                 **tags})
                    ctx.record(rows, split="train")
                    save_unit(ctx, name, {"state": model.state_dict(), **ft_origin})
                    save_classifier(model, ctx.checkpoints / "hf" / name)
                advance(1)

        # diff_init: the interpolation's negative control, the stock_ft recipe from another random init ----
        if cfg.interpolation and cfg.diff_init:
            if loaded:
                ctx.log("diff_init skipped: the stock comes from --model, so there is no other init to train")
            elif finished(ctx, "diff_init") is None:
                started = time.time()
                other = build_stock(cfg.vit, channels, diff_init_seed(ctx.seed))
                other = pretrained_stock(ctx, data, "diff_init_stock", other, loaded=False)
                other_encoder = encoder_of(other)
                other_head = probe_head(ctx, data, "diff_init_h0", other_encoder)
                model, curve = fine_tune(other_encoder, other_head, data.train.images, data.train.labels,
                                         cfg.ft.steps, cfg.ft.batch_size, cfg.ft.lr, cfg.ft.weight_decay,
                                         cfg.ft.warmup_frac, ctx.seed, ctx.device, augment=cfg.ft.augment)
                ctx.record([{"variant": "diff_init", "metric": "ft_loss", "value": v, "step": s, "stage": "ft"}
                            for s, v in curve]
                           + [{"variant": "diff_init", "metric": "wall_s", "value": time.time() - started,
                               "stage": "ft"}], split="train")
                save_unit(ctx, "diff_init", {"state": model.state_dict(),
                                             "stock": fingerprint(other_encoder.state_dict()),
                                             "h0": fingerprint(other_head.state_dict())})
                save_classifier(model, ctx.checkpoints / "hf" / "diff_init")


def diff_init_seed(seed: int) -> int:
    """The init seed of the diff_init stock: only the init differs (batches and fine-tune use the run's seed)."""
    return seed + DIFF_INIT_SEED_OFFSET


def pretrained_stock(ctx: RunContext, data: Data, unit: str, stock, loaded: bool):
    """θ₀: MAE pre-training of `stock` on the clean train+val images (unless it came from --model or
    stock.steps is 0), saved as `unit`; --resume reloads it."""
    import torch

    from icml.methods.soup.soups import fingerprint
    from icml.methods.soup.ssl import pretrain_mae
    from icml.methods.soup.vit import encoder_of

    cfg = ctx.config
    done = finished(ctx, unit)
    if done is not None:
        stock.load_state_dict(done["state"])
    elif not loaded and cfg.stock.steps > 0:
        started = time.time()
        with ctx.progress(f"{unit}: MAE pre-training", None):
            clean = torch.cat([data.train.images, data.val.images])
            stock, curve = pretrain_mae(stock, clean, cfg.stock.steps, cfg.stock.batch_size, cfg.stock.lr,
                                        cfg.stock.mask, ctx.seed, ctx.device)
        ctx.record([{"variant": unit, "metric": "ssl_loss", "value": v, "step": s, "stage": "ssl",
                     "algo": "mae", "ssl_pool": "clean"} for s, v in curve]
                   + [{"variant": unit, "metric": "wall_s", "value": time.time() - started, "stage": "ssl"}],
                   split="train")
    if done is None:  # θ₀ as trained here, or as loaded / left at its init
        save_unit(ctx, unit, {"state": stock.state_dict(), "stock": fingerprint(encoder_of(stock).state_dict())})
    return stock.to(ctx.device).eval()


def probe_head(ctx: RunContext, data: Data, unit: str, encoder):
    """h0: the linear probe on standardised features of `encoder`, its lr picked on val; saved as `unit`."""
    import torch

    from icml.methods.soup.soups import features_of, fingerprint, fit_probe

    cfg = ctx.config
    done = finished(ctx, unit)
    if done is None:
        train_z = features_of(encoder, data.train.images, ctx.device)
        val_z = features_of(encoder, data.val.images, ctx.device)
        head, lr = fit_probe(train_z, data.train.labels, val_z, data.val.labels, len(data.classes),
                             cfg.ft.probe_lrs, cfg.ft.probe_steps, ctx.seed)
        done = {"state": head.state_dict(), "lr": lr, "stock": fingerprint(encoder.state_dict())}
        save_unit(ctx, unit, done)
    head = torch.nn.Linear(encoder.config.hidden_size, len(data.classes))
    head.load_state_dict(done["state"])
    ctx.log(f"{unit}: linear probe on standardised features, lr {done['lr']:g} (picked on val)")
    return head


def variant_name(recipe_name: str, pool: str) -> str:
    """ingredient_<algo>_<hp> (cooked on U) or clean_<algo>_<hp> (control); its SSL encoder's unit is
    ssl_<variant>, its fine-tune back the variant itself."""
    return f"ingredient_{recipe_name}" if pool == "shift" else f"clean_{recipe_name}"


def supervised_grid(cfg) -> list[tuple[float, int]]:
    return [(float(m), s) for m in cfg.supervised.lr_multipliers for s in range(cfg.supervised.seeds)]


def supervised_names(cfg) -> list[str]:
    return ["stock_ft" if (m, s) == (1.0, 0) else f"supervised_m{m:g}_s{s}" for m, s in supervised_grid(cfg)]


def _encoder_with(encoder, state: dict):
    model = copy.deepcopy(encoder)
    model.load_state_dict(state)
    return model


def save_classifier(model, folder: Path) -> None:
    """encoder with save_pretrained, the linear head beside it (head.pt: weight, bias); rank 0 alone."""
    if not distributed.is_main():
        return
    import torch

    model.encoder.save_pretrained(folder)
    torch.save(model.head.state_dict(), folder / "head.pt")


# eval ------------------------------------------------------------------------------------------------------
class Scorer:
    """Scores a predictor (images → logits) on clean test/val and every corrupted set; keeps the logits
    so ensembles are means of already computed logits."""

    def __init__(self, data: Data, device: str, with_val_shift: bool, severities: list[int]):
        self.data, self.device, self.with_val_shift = data, device, with_val_shift
        self.severities = tuple(severities)

    def _sets(self, full: bool):
        yield ("val", None, None), self.data.val
        if self.with_val_shift:
            for (kind, severity), split in self.data.val_sets.items():
                yield ("val", kind, severity), split
        if full:
            yield ("test", None, None), self.data.test
            for (kind, severity), split in self.data.test_sets.items():
                if severity in self.severities:
                    yield ("test", kind, severity), split

    def logits(self, predict, full: bool = True, val_shift: bool = True) -> dict:
        import torch

        out = {}
        with torch.no_grad():
            for key, split in self._sets(full):
                if key[1] is not None and key[0] == "val" and not val_shift:
                    continue
                out[key] = torch.cat([predict(split.images[i:i + 1000].to(self.device)).float().cpu()
                                      for i in range(0, len(split), 1000)])
        return out

    def accuracies(self, logits: dict) -> dict:
        labels = {}
        for key, split in self._sets(True):
            labels[key] = split.labels
        return {key: float((value.argmax(1) == labels[key]).float().mean()) for key, value in logits.items()}

    def selection(self, accuracies: dict, on: str) -> float:
        """The held-out score for greedy soups and best single: clean val, or seen-type corrupted val."""
        if on == "val_clean":
            return accuracies[("val", None, None)]
        seen = [v for (split, kind, _), v in accuracies.items() if split == "val" and kind in self.data.seen]
        return sum(seen) / len(seen)


def benchmark_rows(accuracies: dict, data: Data, reference: dict | None) -> list[dict]:
    """clean_acc, val_acc, corruption_acc per (type, severity), per type (severity mean) and per
    benchmark × shift (seen|heldout|all) — test rows, plus the val means — and, against stock_ft's
    accuracies, mce and gain_vs_stock."""
    import numpy as np

    benchmark_of = data.benchmark_of
    rows = [{"metric": "clean_acc", "value": accuracies[("test", None, None)], "benchmark": "clean",
             "split": "test"},
            {"metric": "val_acc", "value": accuracies[("val", None, None)], "benchmark": "clean", "split": "val"}]
    for split in ("test", "val"):
        per_type: dict[str, list[float]] = {}
        for (where, kind, severity), acc in accuracies.items():
            if where != split or kind is None:
                continue
            per_type.setdefault(kind, []).append(acc)
            if split == "test":
                rows.append({"metric": "corruption_acc", "value": acc, "benchmark": benchmark_of(kind),
                             "shift": _shift_of(kind, data), "corruption": kind, "severity": str(severity),
                             "split": split})
        type_mean = {kind: float(np.mean(v)) for kind, v in per_type.items()}
        mce_of = {}
        if reference is not None and split == "test":
            for kind in per_type:
                errors = sum(1 - accuracies[k] for k in accuracies if k[0] == split and k[1] == kind)
                stock_errors = sum(1 - reference[k] for k in reference if k[0] == split and k[1] == kind)
                mce_of[kind] = 100 * errors / max(stock_errors, 1e-12)
        for kind, value in type_mean.items():
            tags = {"benchmark": benchmark_of(kind), "shift": _shift_of(kind, data), "corruption": kind,
                    "severity": "mean", "split": split}
            if split == "test":
                rows.append({"metric": "corruption_acc", "value": value, **tags})
                if kind in mce_of:
                    rows.append({"metric": "mce", "value": mce_of[kind], **tags})
        for benchmark in sorted({benchmark_of(k) for k in type_mean}):
            kinds = [k for k in type_mean if benchmark_of(k) == benchmark]
            for shift in ("seen", "heldout", "all") if split == "test" else ("seen",):  # val: seen types only
                chosen = [k for k in kinds if shift == "all" or _shift_of(k, data) == shift]
                if not chosen:
                    continue
                tags = {"benchmark": benchmark, "shift": shift, "corruption": "mean", "severity": "mean",
                        "split": split}
                value = float(np.mean([type_mean[k] for k in chosen]))
                rows.append({"metric": "corruption_acc", "value": value, **tags})
                if mce_of:
                    rows.append({"metric": "mce", "value": float(np.mean([mce_of[k] for k in chosen])), **tags})
                if reference is not None:
                    stock_mean = np.mean([np.mean([reference[k] for k in reference
                                                   if k[0] == split and k[1] == kind]) for kind in chosen])
                    rows.append({"metric": "gain_vs_stock", "value": 100 * (value - float(stock_mean)), **tags})
    return rows


def _shift_of(kind: str, data: Data) -> str:
    return "heldout" if kind in data.heldout else "seen"


def evaluate(ctx: RunContext) -> None:
    from transformers.utils import logging as hf_logging

    from icml.cli.threads import single_thread

    hf_logging.disable_progress_bar()
    with single_thread():
        Evaluation(ctx).run()


class Evaluation:
    """Every variant of the spec, built from the trained units and scored; rows recorded at the end."""

    def __init__(self, ctx: RunContext):
        import torch

        from icml.methods.soup.soups import fingerprint
        from icml.methods.soup.vit import Classifier, encoder_of

        self.ctx = ctx
        cfg = self.cfg = ctx.config
        self.started = time.time()
        size, channels = input_spec(ctx)
        self.data = prepare_data(cfg, ctx.seed, size, channels)
        stock, _ = _stock(ctx, channels)
        stock.load_state_dict(self._unit("stock"))
        self.recipes = recipes_of(ctx, stock)
        self.controls = control_recipes(self.recipes) if cfg.controls else []
        self.encoder = encoder_of(stock).to(ctx.device).eval()
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, len(self.data.classes))
        self.head.load_state_dict(self._unit("h0"))
        self.template = Classifier(copy.deepcopy(self.encoder), copy.deepcopy(self.head)).to(ctx.device).eval()
        self.names = [variant_name(r.name, "shift") for r in self.recipes]
        self.control_names = [variant_name(r.name, "clean") for r in self.controls]
        ssl_units = {n: self._payload("ssl_" + n) for n in self.names + self.control_names}
        ft_units = {n: self._payload(n) for n in ["stock_ft", *self.names, *self.control_names,
                                                  *supervised_names(cfg)]}
        self.ssl = {n: unit["state"] for n, unit in ssl_units.items()}
        self.ft = {n: unit["state"] for n, unit in ft_units.items()}
        # the θ₀ (and h0) each unit started from: soups of different stocks are refused
        stock_origin = fingerprint(self.encoder.state_dict())
        self.ssl_origin = {"stock": stock_origin, **{n: unit.get("stock") for n, unit in ssl_units.items()}}
        self.ft_origin = {n: unit.get("stock") for n, unit in ft_units.items()}
        self.head_origin = {n: unit.get("h0") for n, unit in ft_units.items()}
        self.run_origin = {"stock": stock_origin, "h0": fingerprint(self.head.state_dict())}
        self.scorer = Scorer(self.data, ctx.device, bool(self.data.val_sets), cfg.eval_severities)
        self.logits: dict[str, dict] = {}
        self.accuracy: dict[str, dict] = {}
        self.tags: dict[str, dict] = {}
        self.states: dict[str, dict] = {}
        self.rows: list[dict] = []
        self.ft_cache: dict[str, dict] = {}

    def _payload(self, name: str) -> dict:
        unit = saved(self.ctx, name)
        if unit is None:
            raise IcmlError(f"checkpoint of '{name}' is missing in {self.ctx.run.path}",
                            f"finish training: icml soup train --resume {self.ctx.run.path}")
        return unit

    def _unit(self, name: str) -> dict:
        return self._payload(name)["state"]

    def check_one_stock(self, variant: str, members: list[str], order: str) -> None:
        """Every member of a soup must have started from this run's θ₀ (and, for souped classifiers, its h0)."""
        from icml.methods.soup.soups import check_one_stock

        members = [m for m in members if m != "stock"]
        if order == "ft_then_soup":
            checks = [("stock", self.ft_origin), ("probe h0", self.head_origin)]
        else:
            checks = [("stock", self.ssl_origin)]
        for what, origin in checks:
            run = self.run_origin["stock" if what == "stock" else "h0"]
            try:
                check_one_stock({f"this run's {what}": run, **{m: origin[m] for m in members}}, what)
            except ValueError as exc:
                foreign = [m for m in members if origin[m] != run]
                files = [f for m in foreign for f in ((f"ssl_{m}.pt", f"{m}.pt") if m in self.ssl else (f"{m}.pt",))]
                raise IcmlError(f"{variant} is not a soup of one stock: {exc}",
                                f"retrain them in this run: delete {', '.join(files)} in "
                                f"{self.ctx.checkpoints / 'units'} and run icml soup train --resume "
                                f"{self.ctx.run.path}") from None

    # building blocks -------------------------------------------------------------------------------
    def classifier(self, state: dict):
        from icml.methods.soup.soups import with_state

        return with_state(self.template, state)

    def fine_tune_encoder(self, key: str, encoder_state: dict) -> dict:
        """soup-then-FT: LP-FT of an (souped) encoder from the shared h0, like every ingredient's."""
        from icml.methods.soup.soups import fine_tune

        if key not in self.ft_cache:
            cfg = self.cfg
            started = time.time()
            model, curve = fine_tune(_encoder_with(self.encoder, encoder_state), self.head, self.data.train.images,
                                     self.data.train.labels, cfg.ft.steps, cfg.ft.batch_size, cfg.ft.lr,
                                     cfg.ft.weight_decay, cfg.ft.warmup_frac, self.ctx.seed, self.ctx.device,
                                     augment=cfg.ft.augment)
            self.rows += [{"variant": key, "metric": "ft_loss", "value": v, "step": s, "stage": "ft",
                           "order": "soup_then_ft", "split": "train"} for s, v in curve]
            self.rows.append({"variant": key, "metric": "wall_s", "value": time.time() - started, "stage": "ft",
                              "order": "soup_then_ft", "split": "train"})
            self.ft_cache[key] = model.state_dict()
        return self.ft_cache[key]

    def score(self, variant: str, state: dict | None = None, logits: dict | None = None, **tags) -> None:
        if logits is None:
            logits = self.scorer.logits(self.classifier(state))
        self.logits[variant] = logits
        self.accuracy[variant] = self.scorer.accuracies(logits)
        self.tags[variant] = _tags(**tags)
        if state is not None:
            self.states[variant] = state

    def val_selection(self, state: dict) -> float:
        logits = self.scorer.logits(self.classifier(state), full=False,
                                    val_shift=self.cfg.greedy.on == "val_shift")
        return self.scorer.selection(self.scorer.accuracies(logits), self.cfg.greedy.on)

    def knn_selection(self, encoder_state: dict) -> float:
        """Held-out score of an SSL encoder (soup_then_ft greedy): weighted kNN on val, bank clean train."""
        from icml.methods.soup.soups import features_of, knn_predict

        encoder = _encoder_with(self.encoder, encoder_state)
        bank = features_of(encoder, self.data.train.images, self.ctx.device)
        splits = [self.data.val] if self.cfg.greedy.on == "val_clean" else \
            [s for (k, _), s in self.data.val_sets.items() if k in self.data.seen]
        scores = [float((knn_predict(bank, self.data.train.labels, features_of(encoder, s.images, self.ctx.device),
                                     len(self.data.classes), self.cfg.knn_k, self.cfg.knn_temperature)
                         == s.labels).float().mean()) for s in splits]
        return sum(scores) / len(scores)

    def soup(self, variant: str, members: list[str], order: str, weights: list[float] | None = None,
             pool: str = "shift", algo: str = "mix") -> None:
        """A soup of `members` (variant names) in `order`; scored as `variant`."""
        from icml.methods.soup.soups import soup_state

        self.check_one_stock(variant, members, order)
        weights = weights or [1 / len(members)] * len(members)
        if order == "ft_then_soup":
            state = soup_state([self.ft[m] for m in members], weights)
        else:
            encoder_state = soup_state([self.ssl_or_stock(m) for m in members], weights)
            state = self.fine_tune_encoder(variant, encoder_state)
        self.score(variant, state, order=order, ssl_pool=pool, algo=algo, stage="ft")
        self.rows += [{"variant": variant, "metric": "soup_weight", "value": w, "ingredient": m, "order": order,
                       "stage": "ft" if order == "ft_then_soup" else "ssl", "split": "test"}
                      for m, w in zip(members, weights)]

    def ssl_or_stock(self, name: str) -> dict:
        return self.encoder.state_dict() if name in ("stock", "stock_ft") else self.ssl[name]

    # the variants -------------------------------------------------------------------------------
    def run(self) -> None:
        from icml.methods.soup.config import ORDERS

        ctx, cfg = self.ctx, self.cfg
        main = cfg.order
        other = [o for o in ORDERS if o != main][0]
        steps = 8 + len({r.algo for r in self.recipes})
        with ctx.progress("soups and evaluation", steps) as advance:
            self.score("stock_ft", self.ft["stock_ft"], stage="ft")
            for recipe, name in zip(self.recipes, self.names):
                self.score(name, self.ft[name], stage="ft", algo=recipe.algo, ingredient=recipe.name,
                           ssl_pool="shift")
            advance(1)
            self.soup("self_soup_uniform", self.names, main)
            self.soup("self_soup_then_ft" if other == "soup_then_ft" else "self_ft_then_soup", self.names, other)
            advance(1)
            self.greedy("self_soup_greedy", self.names, main)
            advance(1)
            self.season()
            advance(1)
            for algo in dict.fromkeys(r.algo for r in self.recipes):
                members = [n for r, n in zip(self.recipes, self.names) if r.algo == algo]
                self.soup(f"soup_{algo}", members, main, algo=algo)  # one member: a real soup (tested ≡ it)
                advance(1)
            if self.control_names:
                self.soup("soup_clean_ssl", self.control_names, main, pool="clean")
            advance(1)
            supervised = supervised_names(cfg)
            if "supervised_m1_s1" in supervised:  # stock_ft with another seed: the fine-tune seed noise
                self.score("supervised_m1_s1", self.ft["supervised_m1_s1"], stage="ft")
            self.soup("supervised_soup_uniform", supervised, "ft_then_soup", pool=None, algo="supervised")
            self.greedy("supervised_soup_greedy", supervised, "ft_then_soup", algo="supervised", pool=None)
            advance(1)
            ensemble = {key: sum(self.logits[n][key] for n in self.names) / len(self.names)
                        for key in self.logits[self.names[0]]}
            self.score("ensemble", logits=ensemble, stage="ft", ssl_pool="shift")
            advance(1)
            self.diagnostics()
            advance(1)
            if cfg.interpolation:
                self.interpolation(main)
            advance(1)
        self.record()

    def greedy(self, variant: str, members: list[str], order: str, algo: str = "mix", pool: str | None = "shift"):
        from icml.methods.soup.soups import greedy_soup, soup_state

        self.check_one_stock(variant, members, order)
        if order == "ft_then_soup":
            scores = [self.val_selection(self.ft[m]) for m in members]
            kept, _ = greedy_soup(scores, lambda idx: self.val_selection(
                soup_state([self.ft[members[i]] for i in idx])))
        else:
            scores = [self.knn_selection(self.ssl[m]) for m in members]
            kept, _ = greedy_soup(scores, lambda idx: self.knn_selection(
                soup_state([self.ssl[members[i]] for i in idx])))
        chosen = [members[i] for i in kept]
        self.soup(variant, chosen, order, algo=algo, pool=pool)

    def season(self) -> None:
        """self_season_soup: w = softmax(β) over the SSL encoders {stock, ingredients} (as released: before
        any fine-tune), learnt label-free on U, then fine-tuned back once."""
        from icml.methods.soup.soups import FeatureNet, season_weights, soup_state

        cfg = self.cfg.season
        members = ["stock", *self.names]
        self.check_one_stock("self_season_soup", members, "soup_then_ft")
        states = [{"encoder." + k: v for k, v in self.ssl_or_stock(m).items()} for m in members]
        weights, _ = season_weights(FeatureNet(copy.deepcopy(self.encoder)), states, self.data.pool, cfg.epochs,
                                    cfg.steps_per_epoch, cfg.batch_size, cfg.top_k, cfg.temperature, cfg.lr,
                                    cfg.final_lr, self.ctx.seed, self.ctx.device)
        total = sum(weights)
        weights = [w / total for w in weights]  # exact Σw = 1 after float32 softmax
        encoder_state = soup_state([self.ssl_or_stock(m) for m in members], weights)
        state = self.fine_tune_encoder("self_season_soup", encoder_state)
        self.score("self_season_soup", state, order="soup_then_ft", ssl_pool="shift", algo="mix", stage="ft")
        self.rows += [{"variant": "self_season_soup", "metric": "soup_weight", "value": w, "ingredient": m,
                       "order": "soup_then_ft", "stage": "ssl", "split": "test"} for m, w in zip(members, weights)]

    def diagnostics(self) -> None:
        """knn_acc of the SSL encoders; dist_from_stock and task_vector_cos at both stages."""
        from icml.methods.soup.soups import dist_from_stock, features_of, knn_predict, task_vector_cos

        data, device, cfg = self.data, self.ctx.device, self.cfg
        stock_ssl = self.encoder.state_dict()
        stock_ft_origin = self.template.state_dict()  # (θ₀, h0): where every fine-tune starts
        encoders = {"stock": stock_ssl, **self.ssl}
        for name, state in encoders.items():
            encoder = _encoder_with(self.encoder, state)
            bank = features_of(encoder, data.train.images, device)
            tags = {"stage": "ssl", "ssl_pool": None if name == "stock" else
                    ("clean" if name.startswith("clean_") else "shift")}
            sets = [("test", "clean", None, data.test), ("val", "clean", None, data.val)]
            for split, benchmark, shift, chosen in sets:
                predicted = knn_predict(bank, data.train.labels, features_of(encoder, chosen.images, device),
                                        len(data.classes), cfg.knn_k, cfg.knn_temperature)
                self.rows.append({"variant": name, "metric": "knn_acc", "split": split, "benchmark": benchmark,
                                  "value": float((predicted == chosen.labels).float().mean()), **_tags(**tags)})
            seen = [s for (k, sev), s in data.test_sets.items() if k in data.seen and sev in cfg.eval_severities]
            if seen:
                import torch

                stride = max(1, sum(len(s) for s in seen) // KNN_SHIFT_IMAGES)  # a fixed, spread subsample
                images = torch.cat([s.images for s in seen])[::stride]
                labels = torch.cat([s.labels for s in seen])[::stride]
                predicted = knn_predict(bank, data.train.labels, features_of(encoder, images, device),
                                        len(data.classes), cfg.knn_k, cfg.knn_temperature)
                self.rows.append({"variant": name, "metric": "knn_acc", "split": "test", "benchmark": "all",
                                  "shift": "seen", "corruption": "mean", "severity": "mean",
                                  "value": float((predicted == labels).float().mean()), **_tags(**tags)})
            if name != "stock":
                self.rows.append({"variant": name, "metric": "dist_from_stock", "split": "test",
                                  "value": dist_from_stock(state, stock_ssl), **_tags(**tags)})
                self.rows.append({"variant": name, "metric": "dist_from_stock", "split": "test", "stage": "ft",
                                  "value": dist_from_stock(self.ft[name], stock_ft_origin)})
        for variant in ("stock_ft", "self_soup_uniform"):
            self.rows.append({"variant": variant, "metric": "dist_from_stock", "split": "test", "stage": "ft",
                              "value": dist_from_stock(self.states[variant], stock_ft_origin)})
        names = self.names
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                pair = f"{a.removeprefix('ingredient_')}|{b.removeprefix('ingredient_')}"
                self.rows.append({"variant": "ingredients", "metric": "task_vector_cos", "stage": "ssl", "pair": pair,
                                  "split": "test", "value": task_vector_cos(self.ssl[a], self.ssl[b], stock_ssl)})
                self.rows.append({"variant": "ingredients", "metric": "task_vector_cos", "stage": "ft", "pair": pair,
                                  "split": "test",
                                  "value": task_vector_cos(self.ft[a], self.ft[b], stock_ft_origin)})

    def interpolation(self, main: str) -> None:
        """Linear paths θ_α = (1−α)θa + αθb: fine-tuned pairs by clean val loss/acc (+ interp_barrier),
        SSL encoder pairs by kNN val accuracy; rows to interp.parquet."""
        import pandas as pd
        import torch.nn.functional as F

        from icml.methods.soup.soups import features_of, interpolate, interpolation_barrier, knn_predict, logits_of

        data, device, cfg = self.data, self.ctx.device, self.cfg
        short = [n.removeprefix("ingredient_") for n in self.names]
        pairs = [p for p in INTERP_PAIRS if p[0] in short and p[1] in short] or \
            ([(short[0], short[1])] if len(short) > 1 else [])
        paths = [(f"{a}|{b}", self.ft["ingredient_" + a], self.ft["ingredient_" + b], "ft") for a, b in pairs]
        paths += [(f"{a}|{b}", self.ssl["ingredient_" + a], self.ssl["ingredient_" + b], "ssl") for a, b in pairs]
        paths.append(("stock_ft|self_soup_uniform", self.states["stock_ft"], self.states["self_soup_uniform"], "ft"))
        if cfg.diff_init:
            other = saved(self.ctx, "diff_init")
            if other is not None:
                paths.append(("stock_ft|diff_init", self.states["stock_ft"], other["state"], "ft"))
            else:
                self.ctx.log("diff_init: this run has no diff_init checkpoint (trained without it); pair skipped")
        table = []
        for pair, state_a, state_b, stage in paths:
            losses = []
            for alpha in ALPHAS:
                state = interpolate(state_a, state_b, alpha)
                if stage == "ft":
                    logits = logits_of(self.classifier(state), data.val.images, device)
                    loss = float(F.cross_entropy(logits, data.val.labels))
                    acc = float((logits.argmax(1) == data.val.labels).float().mean())
                    losses.append(loss)
                    table += [(pair, stage, alpha, "val", "loss", loss), (pair, stage, alpha, "val", "acc", acc)]
                else:
                    encoder = _encoder_with(self.encoder, state)
                    bank = features_of(encoder, data.train.images, device)
                    predicted = knn_predict(bank, data.train.labels, features_of(encoder, data.val.images, device),
                                            len(data.classes), cfg.knn_k, cfg.knn_temperature)
                    table.append((pair, stage, alpha, "val", "knn_acc",
                                  float((predicted == data.val.labels).float().mean())))
            if stage == "ft":
                self.rows.append({"variant": "interpolation", "metric": "interp_barrier", "pair": pair,
                                  "stage": stage, "split": "val", "value": interpolation_barrier(losses, ALPHAS)})
        frame = pd.DataFrame(table, columns=["pair", "stage", "alpha", "split", "metric", "value"])
        frame.insert(0, "run_id", self.ctx.run.path.name)
        self.ctx.write_table("interp", frame)

    def record(self) -> None:
        """Every scored variant gets the same tag grid; best_single_ingredient copies the ingredient
        that scores best on the held-out selection."""
        cfg = self.cfg
        reference = self.accuracy["stock_ft"]
        best = max(self.names, key=lambda n: self.scorer.selection(self.accuracy[n], cfg.greedy.on))
        self.accuracy["best_single_ingredient"] = self.accuracy[best]
        self.tags["best_single_ingredient"] = {**self.tags[best], "ingredient": best.removeprefix("ingredient_")}
        rows = []
        for variant, accuracies in self.accuracy.items():
            for row in benchmark_rows(accuracies, self.data, reference):
                rows.append({"variant": variant, **self.tags[variant], **row})
        rows += self.rows
        rows.append({"variant": "eval", "metric": "wall_s", "value": time.time() - self.started, "stage": "eval",
                     "split": "test"})
        split_rows: dict[str, list[dict]] = {}
        for row in rows:
            split_rows.setdefault(row.pop("split"), []).append(row)
        for split, chunk in split_rows.items():
            self.ctx.record(chunk, split=split)
