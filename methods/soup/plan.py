"""`icml soup plan`: one AdamW step of each SSL algorithm among the ingredients and one fine-tune step, per
process, and the evaluation's soups and scoring, at the preset's sizes on the meta device (cli/plan.py).

Under torchrun every process draws the global batch's augmented views and trains on its equal slice of them
(distributed.shard; the contrastive losses gather the slices' embeddings). The plan runs each step on one
process's slice (batch / processes images); the global batch's views before the slicing (ssl.batch_size × 3 ×
224² floats, 38 MB at 64 images) are left out. Evaluation runs in one process.
"""
from __future__ import annotations

import torch

from icml.cli.plan import Hardware, Step
from icml.methods.soup.config import channels_of, parse_ingredients
from icml.methods.soup.pipeline import control_recipes, supervised_names
from icml.methods.soup.soups import FeatureNet, ft_step, season_step, soup_state, stack_states
from icml.methods.soup.ssl import ssl_setup, ssl_step
from icml.methods.soup.vit import Classifier, adamw, build_stock, encoder_of

LAYOUT = "torchrun: one process per GPU, data-parallel over every network's batch (gradients averaged)"
OVERSIZE = ["ssl.batch_size=8192"]
SCORE_CHUNK = 1000  # Scorer.logits: images per forward


def hardware(preset: str) -> Hardware:
    return Hardware(8, 80e9) if preset == "paper" else Hardware(1, 80e9)


def _paper_like(cfg) -> bool:
    """stock.steps = 0: the stock is --model's ViT-MAE-Base (RGB, ImageNet-C's 1 000 classes); otherwise the
    toy stock on the digits (1 channel, 10 classes)."""
    return cfg.stock.steps == 0


def _spec(cfg) -> tuple[int, int, int]:
    """(image size, channels, classes) of the preset."""
    paper = _paper_like(cfg)
    return cfg.vit.image_size, 3 if paper else channels_of(cfg), 1000 if paper else 10


def _stock(cfg, tracker):
    _, channels, _ = _spec(cfg)
    with torch.device(tracker.device):  # the architecture of --model (vit-mae-base's sizes in the paper preset)
        return build_stock(cfg.vit, channels, 0)


def _images(cfg, n: int, tracker) -> torch.Tensor:
    size, channels, _ = _spec(cfg)
    return torch.rand(n, channels, size, size, device=tracker.device)


def _ssl(cfg, recipe, processes: int):
    def run(tracker):
        stock = _stock(cfg, tracker).eval()  # θ₀ stays on the device while an ingredient cooks
        model, head, params, optimizer, schedule, key_encoder = ssl_setup(
            recipe, stock, cfg.ssl.steps, cfg.ssl.lr, cfg.ssl.weight_decay, cfg.ssl.warmup_frac, 0, tracker.device,
            cfg.mocov3.momentum)
        tracker.watch(stock, model, optimizer, *(m for m in (head, key_encoder) if m is not None))
        generator = torch.Generator().manual_seed(0)
        images = _images(cfg, max(1, cfg.ssl.batch_size // processes), tracker)
        for step in range(2):  # the second step holds AdamW's state from its start
            ssl_step(recipe, model, head, params, optimizer, schedule, images, generator, step, key_encoder,
                     cfg.mocov3.momentum, cfg.mocov3.symmetric, cfg.ssl.mae_augment)
    return run


def _ft(cfg, processes: int):
    def run(tracker):
        _, _, classes = _spec(cfg)
        encoder = encoder_of(_stock(cfg, tracker))
        with torch.device(tracker.device):
            head = torch.nn.Linear(encoder.config.hidden_size, classes)
        model = Classifier(encoder, head).train()
        optimizer, schedule = adamw(model.parameters(), cfg.ft.lr, cfg.ft.weight_decay, max(1, cfg.ft.steps),
                                    cfg.ft.warmup_frac)
        tracker.watch(model, optimizer)
        batch = max(1, cfg.ft.batch_size // processes)
        images = _images(cfg, batch, tracker)
        labels = torch.randint(classes, (batch,), device=tracker.device)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):
            ft_step(model, optimizer, schedule, images, labels, generator, cfg.ft.augment)
    return run


def _units(cfg) -> tuple[list[str], list[str]]:
    """(SSL encoder units, fine-tuned classifier units) that eval reads back: under --device cuda
    load_checkpoint restores them onto the GPU they were saved from."""
    recipes = parse_ingredients(cfg.ingredients)
    names = [f"ingredient_{r.name}" for r in recipes]
    controls = [f"clean_{r.name}" for r in control_recipes(recipes)] if cfg.controls else []
    ft = ["stock_ft", *names, *controls, *[n for n in supervised_names(cfg) if n != "stock_ft"]]
    return names + controls, ft


def _soups(cfg):
    """The soups of eval: every unit's state resident, the uniform soup of the ingredients (soup_state), and one
    self-seasoning step of β over {stock, ingredients} stacked (stack_states, season_step)."""
    def run(tracker):
        _, _, classes = _spec(cfg)
        encoder = encoder_of(_stock(cfg, tracker)).eval()
        with torch.device(tracker.device):
            template = Classifier(encoder, torch.nn.Linear(encoder.config.hidden_size, classes)).eval()
        tracker.watch(template)
        ssl_names, ft_names = _units(cfg)
        ingredients = [n for n in ssl_names if n.startswith("ingredient_")]
        with tracker.buffers():  # the soup's state dicts: the units as eval holds them
            ssl = {n: {k: torch.empty_like(v) for k, v in encoder.state_dict().items()} for n in ssl_names}
            ft = {n: {k: torch.empty_like(v) for k, v in template.state_dict().items()} for n in ft_names}
            uniform = soup_state([ssl[n] for n in ingredients])
            states = [{"encoder." + k: v for k, v in s.items()}
                      for s in [encoder.state_dict()] + [ssl[n] for n in ingredients]]
            stacked = stack_states(states, tracker.device)
            beta = torch.zeros(len(states), device=tracker.device, requires_grad=True)
        optimizer = torch.optim.Adam([beta], lr=cfg.season.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        tracker.watch(optimizer)
        module = FeatureNet(encoder)
        season_step(module, stacked, beta, optimizer, schedule, _images(cfg, cfg.season.batch_size, tracker),
                    cfg.season.top_k, cfg.season.temperature)
        del ft, uniform
    return run


def _score(cfg):
    def run(tracker):
        _, _, classes = _spec(cfg)
        encoder = encoder_of(_stock(cfg, tracker))
        with torch.device(tracker.device):
            model = Classifier(encoder, torch.nn.Linear(encoder.config.hidden_size, classes)).eval()
        tracker.watch(model)
        with torch.no_grad():
            model(_images(cfg, SCORE_CHUNK, tracker)).float()
    return run


def steps(cfg, processes: int) -> list[Step]:
    size = cfg.vit.image_size
    out = []
    for recipe in control_recipes(parse_ingredients(cfg.ingredients)):  # one per algorithm: their sizes agree
        out.append(Step("train", f"ssl {recipe.name}: an AdamW step on {max(1, cfg.ssl.batch_size // processes)} "
                                 f"images of {size} px per process (global batch {cfg.ssl.batch_size})",
                        _ssl(cfg, recipe, processes), repeats=2))
    out.append(Step("train", f"fine-tune (LP-FT): an AdamW step on {max(1, cfg.ft.batch_size // processes)} images "
                             f"per process (global batch {cfg.ft.batch_size})", _ft(cfg, processes), repeats=2))
    ssl_names, ft_names = _units(cfg)
    out.append(Step("eval", f"soups: {len(ssl_names)} SSL encoders and {len(ft_names)} fine-tuned classifiers "
                            f"held, the uniform soup, one self-seasoning step on {cfg.season.batch_size} images",
                    _soups(cfg)))
    out.append(Step("eval", f"score: one forward of {SCORE_CHUNK} test images", _score(cfg)))
    return out
