"""The two data tiers.

- Conditional 2-D GMM: 16 means on the unit circle at angles 2πk/16; component k belongs to class k mod 4;
  class c puts 0.7 on component c and 0.1 on each of c+4, c+8, c+12 (its minority modes); σ = 0.05.
- Digits: sklearn digits (8×8, 0–16) → /16 → bilinear 16×16 → [−1, 1], seeded stratified 80/20 split
  (the held-out 20 % is the real reference), or a user's .npz of `images` and `labels` through the same path.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from icml.cli.errors import IcmlError

N_COMPONENTS, GMM_CLASSES = 16, 4
DOMINANT, MINORITY = 0.7, 0.1


def gmm_means() -> np.ndarray:
    angles = 2 * np.pi * np.arange(N_COMPONENTS) / N_COMPONENTS
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def component_class(component) -> np.ndarray:
    return np.asarray(component) % GMM_CLASSES


def class_components(c: int) -> np.ndarray:
    """Class c's components, dominant first: c, c+4, c+8, c+12."""
    return c + GMM_CLASSES * np.arange(N_COMPONENTS // GMM_CLASSES)


def gmm_sample(n_per_class: int, sigma: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points [n, 2], class labels, components), class-balanced."""
    rng = np.random.default_rng(seed)
    weights = np.array([DOMINANT] + [MINORITY] * 3)
    labels = np.repeat(np.arange(GMM_CLASSES), n_per_class)
    which = np.concatenate([rng.choice(4, size=n_per_class, p=weights) for _ in range(GMM_CLASSES)])
    components = labels + GMM_CLASSES * which
    points = gmm_means()[components] + sigma * rng.standard_normal((len(labels), 2))
    return points, labels, components


def nearest_component(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the nearest mean, distance to it)."""
    d = np.linalg.norm(points[:, None, :] - gmm_means()[None], axis=-1)
    idx = d.argmin(1)
    return idx, d[np.arange(len(points)), idx]


# digits ------------------------------------------------------------------------------------------------
def _prepare(images: np.ndarray, scale: float):
    """[N, H, W] or [N, 1, H, W] in [0, scale] → float32 tensor [N, 1, 16, 16] in [−1, 1] (bilinear)."""
    import torch
    import torch.nn.functional as F

    x = torch.tensor(np.asarray(images, dtype=np.float64) / scale, dtype=torch.float32)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.shape[-2:] != (16, 16):
        x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    return x.clamp(0, 1) * 2 - 1


def load_user_digits(path: Path) -> tuple[np.ndarray, np.ndarray, float]:
    """A user's .npz: `images` [N,H,W] or [N,1,H,W] (uint8 0–255 or floats in [0, 1]), `labels` ints 0–9."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "images" not in archive or "labels" not in archive:
                raise IcmlError(f"data '{path}' lacks `images` or `labels`",
                                "save it with np.savez(path, images=..., labels=...)")
            images, labels = archive["images"], archive["labels"]
    except (OSError, ValueError) as exc:
        raise IcmlError(f"data '{path}' is not a readable .npz ({str(exc).splitlines()[0]})",
                        "save it with np.savez(path, images=..., labels=...)") from None
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[1] != 1) or len(images) != len(labels):
        raise IcmlError(f"data '{path}': images {images.shape} and labels {labels.shape} do not match",
                        "images must be [N,H,W] or [N,1,H,W] grey images with one label each")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() > 9:
        raise IcmlError(f"data '{path}': labels must be integers 0–9", "relabel the classes 0..9")
    if np.bincount(labels, minlength=10).min() < 2:
        raise IcmlError(f"data '{path}': every class 0–9 needs at least 2 images", "add images of the missing classes")
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    return images, labels.astype(np.int64), scale


def digits_tier(seed: int, data: str | None = None) -> dict:
    """{train, ref}: (images [N,1,16,16] in [−1,1], labels) — seeded stratified 80/20 split."""
    import torch
    from sklearn.model_selection import train_test_split

    if data:
        images, labels, scale = load_user_digits(Path(data))
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images, labels, scale = digits.images, digits.target.astype(np.int64), 16.0
    x = _prepare(images, scale)
    train, ref = train_test_split(np.arange(len(labels)), test_size=0.2, stratify=labels, random_state=seed)
    y = torch.as_tensor(labels)
    return {"train": (x[train], y[train]), "ref": (x[ref], y[ref])}
