"""Evaluation metrics of attribution maps: localisation (GridPG, EnergyPG, pointing game, pixel ROC-AUC),
faithfulness (deletion LeRF/MoRF and insertion with blurred fills), stability (noise, shifts), patch-lattice
artefacts (spectral energy at multiples of 1/patch, gradient ratio across patch borders), class sensitivity.

Maps are torch tensors (B, H, W) or numpy arrays; every function returns one value per image."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from icml.methods.explain_vit.attribution import gaussian_blur, scaled_kernel


def nanmean(a, axis=None):
    """np.nanmean without the warning for an all-NaN slice (a map with no positive mass): NaN."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(a, axis)


def _np(a) -> np.ndarray:
    return a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)


def positive_share(maps, regions) -> np.ndarray:
    """Σ_region max(a, 0) / Σ max(a, 0); NaN for a map without positive attribution."""
    pos = np.clip(_np(maps), 0, None)
    total = pos.reshape(len(pos), -1).sum(1)
    inside = (pos * regions).reshape(len(pos), -1).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, inside / np.where(total > 0, total, 1), np.nan)


def box_masks(boxes: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros((len(boxes),) + shape, dtype=bool)
    for i, (x0, y0, x1, y1) in enumerate(boxes):
        out[i, y0:y1 + 1, x0:x1 + 1] = True
    return out


def energy_pg(maps, boxes: np.ndarray) -> np.ndarray:
    maps = _np(maps)
    return positive_share(maps, box_masks(boxes, maps.shape[1:]))


def cell_masks(shape: tuple[int, int]) -> np.ndarray:
    """(4, H, W) masks of the 2×2 grid cells, row-major."""
    h, w = shape
    out = np.zeros((4, h, w), dtype=bool)
    for k in range(4):
        r, c = divmod(k, 2)
        out[k, r * h // 2:(r + 1) * h // 2, c * w // 2:(c + 1) * w // 2] = True
    return out


def grid_pg(maps_per_cell) -> np.ndarray:
    """maps_per_cell (M, 4, H, W): cell k's map explains cell k's class; mean over the 4 targets."""
    maps = _np(maps_per_cell)
    cells = cell_masks(maps.shape[-2:])
    shares = np.stack([positive_share(maps[:, k], cells[k][None]) for k in range(4)], 1)
    return nanmean(shares, 1)


def dilate(masks: np.ndarray, px: int = 1) -> np.ndarray:
    t = torch.from_numpy(masks.astype(np.float32))[:, None]
    return (F.max_pool2d(t, 2 * px + 1, stride=1, padding=px)[:, 0] > 0).numpy()


def pointing_game(maps, masks: np.ndarray) -> np.ndarray:
    """1 if the map's argmax lies inside the object mask dilated by 1 px."""
    maps = _np(maps)
    hit = dilate(masks, 1).reshape(len(maps), -1)
    top = maps.reshape(len(maps), -1).argmax(1)
    return hit[np.arange(len(maps)), top].astype(np.float64)


def pixel_auroc(maps, masks: np.ndarray) -> np.ndarray:
    from sklearn.metrics import roc_auc_score

    maps = _np(maps)
    out = np.full(len(maps), np.nan)
    for i in range(len(maps)):
        y = masks[i].ravel()
        if 0 < y.sum() < y.size:
            out[i] = roc_auc_score(y, maps[i].ravel())
    return out


def pearson(a, b) -> np.ndarray:
    a, b = _np(a).reshape(len(a), -1), _np(b).reshape(len(b), -1)
    a, b = a - a.mean(1, keepdims=True), b - b.mean(1, keepdims=True)
    den = np.sqrt((a * a).sum(1) * (b * b).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(1) / np.where(den > 0, den, 1), np.nan)


def shift_image(pixels: torch.Tensor, k: int) -> torch.Tensor:
    """Translate by (k, k) px towards the bottom right; the vacated border repeats the edge."""
    padded = F.pad(pixels, (k, 0, k, 0), mode="replicate")
    return padded[..., :pixels.shape[-2], :pixels.shape[-1]]


def shift_overlap(map_of_shifted, map_of_original, k: int) -> tuple[np.ndarray, np.ndarray]:
    """E(shift_k x) and shift_k E(x) over their overlap."""
    a, b = _np(map_of_shifted), _np(map_of_original)
    return a[:, k:, k:], b[:, :-k, :-k]


def lattice_frequencies(side: int, patch: int) -> np.ndarray:
    """FFT bins (cycles per side) at non-zero multiples of 1/patch: f/side = m/patch."""
    bins = np.fft.fftfreq(side) * side  # signed integer bins
    step = side / patch
    return (np.abs(bins) > 0) & np.isclose(np.mod(np.abs(bins), step), 0) if step.is_integer() else np.zeros(side, bool)


def lattice_energy(maps, patch: int) -> np.ndarray:
    """Share of the non-DC spectral energy |FFT(map)|² at lattice frequencies on either axis."""
    maps = _np(maps)
    power = np.abs(np.fft.fft2(maps)) ** 2
    fy, fx = lattice_frequencies(maps.shape[1], patch), lattice_frequencies(maps.shape[2], patch)
    lattice = fy[:, None] | fx[None, :]
    power[:, 0, 0] = 0.0
    total = power.reshape(len(maps), -1).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (power * lattice).reshape(len(maps), -1).sum(1) / np.where(total > 0, total, 1),
                        np.nan)


def lattice_grad_ratio(maps, patch: int) -> np.ndarray:
    """mean |∇map| across patch borders / mean |∇map| within patches (finite differences on both axes)."""
    maps = _np(maps)
    dx, dy = np.abs(np.diff(maps, axis=2)), np.abs(np.diff(maps, axis=1))
    border_x = (np.arange(1, maps.shape[2]) % patch) == 0  # difference between columns j-1 and j
    border_y = (np.arange(1, maps.shape[1]) % patch) == 0
    across = np.concatenate([dx[:, :, border_x].reshape(len(maps), -1), dy[:, border_y].reshape(len(maps), -1)], 1)
    within = np.concatenate([dx[:, :, ~border_x].reshape(len(maps), -1), dy[:, ~border_y].reshape(len(maps), -1)], 1)
    w = within.mean(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(w > 0, across.mean(1) / np.where(w > 0, w, 1), np.nan)


def mean_log_spectrum(maps) -> np.ndarray:
    """The 1-D spectrum along x of maps scaled to unit energy (arms of any scale compare): log10 of the mean
    |FFT|² over rows and images, bins 0…W/2."""
    maps = _np(maps)
    maps = maps / np.maximum(np.sqrt((maps ** 2).sum((1, 2), keepdims=True)), 1e-300)
    power = np.abs(np.fft.fft(maps, axis=2)) ** 2
    return np.log10(power.mean((0, 1)) + 1e-12)[: maps.shape[2] // 2 + 1]


# faithfulness --------------------------------------------------------------------------------------
def blurred(x: torch.Tensor, blur_kernel: int, blur_sigma: float) -> torch.Tensor:
    """The deletion fill: a blurred copy (kernel 31, σ 7 at 224 px, scaled to the side; reflect padding)."""
    side = x.shape[-1]
    return gaussian_blur(x, scaled_kernel(blur_kernel, side), blur_sigma * side / 224, padding="reflect")


def order_pixels(maps: torch.Tensor, most_first: bool, generator: torch.Generator) -> torch.Tensor:
    """Pixel ranks by map value; ties broken at random so flat maps are not read in raster order."""
    flat = maps.flatten(1).double()
    jitter = torch.rand(flat.shape, generator=generator, dtype=torch.float64).to(flat.device)  # the CPU stream
    by_jitter = jitter.argsort(1)  # a random permutation; the stable sort by value below keeps it within ties
    order = flat.gather(1, by_jitter).argsort(dim=1, descending=most_first, stable=True)
    return by_jitter.gather(1, order)


CURVE_IMAGES = 128  # images per chunk of paths: 128 × (steps + 1) rows are whole predict() batches of 128


def perturbation_curves(classifier, x: torch.Tensor, targets: torch.Tensor, maps: torch.Tensor, fill: torch.Tensor,
                        mode: str, steps: int, max_frac: float, generator: torch.Generator) -> np.ndarray:
    """Target softmax along a deletion (lerf | morf) or insertion path, (B, steps + 1). Deleted pixels take
    `fill`'s values; insertion starts from `fill` and restores the most relevant pixels first. The paths are
    built CURVE_IMAGES images at a time (curve_chunk): at 224 px all of them would be (B, steps + 1) images."""
    b, c, h, w = x.shape
    order = order_pixels(maps, most_first=(mode != "lerf"), generator=generator)
    rank = pixel_ranks(order)
    counts = np.round(np.linspace(0, max_frac, steps + 1) * h * w).astype(int)
    start, end = (fill, x) if mode == "insertion" else (x, fill)
    parts = [curve_chunk(classifier, start[i:i + CURVE_IMAGES], end[i:i + CURVE_IMAGES], targets[i:i + CURVE_IMAGES],
                         rank[i:i + CURVE_IMAGES], counts) for i in range(0, b, CURVE_IMAGES)]
    return torch.cat(parts).double().cpu().numpy()


def pixel_ranks(order: torch.Tensor) -> torch.Tensor:
    """rank[b, p]: the position of pixel p in image b's order."""
    b, n = order.shape
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=order.device).expand(b, -1).contiguous())
    return rank


@torch.no_grad()
def curve_chunk(classifier, start: torch.Tensor, end: torch.Tensor, targets: torch.Tensor, rank: torch.Tensor,
                counts: np.ndarray) -> torch.Tensor:
    """(b, len(counts)) target probabilities of the paths from `start` to `end`: after k steps the counts[k]
    first-ranked pixels take `end`'s values."""
    b, c, h, w = start.shape
    points = len(counts)
    changed = rank[:, None, :] < torch.from_numpy(counts).to(rank)[None, :, None]  # (b, points, HW)
    changed = changed.reshape(b, points, 1, h, w).to(start.dtype)
    paths = (start[:, None] * (1 - changed) + end[:, None] * changed).reshape(-1, c, h, w)
    probs = classifier.predict(paths).reshape(b, points, -1)
    return probs.gather(2, targets.reshape(b, 1, 1).expand(b, points, 1))[..., 0]


def curve_auc(curves: np.ndarray, max_frac: float) -> np.ndarray:
    """Trapezoid AUC over the deleted fraction, divided by its span: the mean target probability."""
    fracs = np.linspace(0, max_frac, curves.shape[1])
    return np.trapezoid(curves, fracs, axis=1) / max_frac
