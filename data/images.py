"""Small image-classification data: the digits clean set, a deterministic corruption suite, and
loaders for a user image folder or an ImageNet-C-style shifted folder.

Images are float32 tensors [N, C, H, W] in [0, 1]; labels int64 [N].

- `digits_splits(seed)`: scikit-learn digits scaled by 1/16, bilinearly upsampled 8→16 px, one
  channel, stratified seeded split 1000 train / 297 val / 500 test.
- `corrupt(images, kind, severity, seed, ids)`: one of the 14 corruption types at severity 1–5,
  clipped to [0, 1]. Every random draw for image i comes from a generator seeded by
  (seed, type, severity, ids[i]), so results never depend on batch order or batch size (the two
  donor types, stickers and mosaic, also take their donor images from `images` by id).
- `load_image_folder(dir, …)`: class subfolders, with train/val/test subfolders if present,
  else a seeded stratified split.
- `load_shift_folder(dir, …)`: unlabelled images, or an ImageNet-C layout
  `<type>/<severity>/<class>/*`.

Every loader raises `ImageDataError` (a ValueError) with one line naming the path and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

# benchmark -> corruption types; the order fixes each type's id in the seed
DIGITS_C = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "defocus_blur", "motion_blur",
            "contrast", "fog", "pixelate", "elastic")
DIGITS_LC = ("vertical_lines", "luminance_checkerboard", "stickers", "mosaic")
BENCHMARKS = {"digits_c": DIGITS_C, "digits_lc": DIGITS_LC}
CORRUPTIONS = DIGITS_C + DIGITS_LC
HELDOUT = ("speckle_noise", "fog", "elastic", "mosaic")  # never in the unlabelled pool U
SEVERITIES = (1, 2, 3, 4, 5)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".ppm", ".tif", ".tiff", ".webp")


def _steps(low: float, high: float) -> tuple[float, ...]:
    """A range stepped linearly over the five severities."""
    return tuple(float(v) for v in np.linspace(low, high, 5))


# severity 1→5 parameters, as the spec lists them
PARAMS = {
    "gaussian_noise": (.08, .12, .18, .26, .38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (.03, .06, .09, .17, .27),
    "speckle_noise": (.15, .2, .35, .45, .6),
    "defocus_blur": (.5, .75, 1, 1.5, 2),
    "motion_blur": _steps(2, 6),
    "contrast": (.4, .3, .2, .1, .05),
    "fog": _steps(.2, .6),
    "pixelate": (12, 10, 8, 6, 4),
    "elastic": _steps(.5, 1.5),
    "vertical_lines": (.1, .15, .2, .3, .4),
    "luminance_checkerboard": (.15, .25, .35, .5, .65),
    "stickers": (1, 2, 3, 4, 5),
    "mosaic": _steps(.1, .5),
}


class ImageDataError(ValueError):
    """A dataset that cannot be used; the message is one line naming the path and the fix."""


@dataclass
class Split:
    images: "object"  # torch.Tensor [N, C, H, W]
    labels: "object"  # torch.Tensor [N] int64

    def __len__(self) -> int:
        return len(self.labels)


# clean digits ---------------------------------------------------------------------------------
def digits_splits(seed: int, sizes: tuple[int, int, int] = (1000, 297, 500)) -> dict[str, Split]:
    """sklearn digits → {train, val, test}: /16, bilinear 8→16 px, stratified seeded split."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False).clamp(0, 1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    n_train, n_val, n_test = sizes
    index = np.arange(len(labels))
    rest, test = train_test_split(index, test_size=n_test, stratify=digits.target, random_state=seed)
    train, val = train_test_split(rest, train_size=n_train, test_size=n_val, stratify=digits.target[rest],
                                  random_state=seed)
    return {name: Split(images[torch.as_tensor(idx)], labels[torch.as_tensor(idx)])
            for name, idx in (("train", train), ("val", val), ("test", test))}


# corruptions ----------------------------------------------------------------------------------
def image_rng(seed: int, kind: str, severity: int, image_id: int) -> np.random.Generator:
    """The generator of one corrupted image: (seed, type, severity, id), nothing else."""
    return np.random.default_rng([seed, CORRUPTIONS.index(kind), severity, int(image_id)])


@lru_cache(maxsize=None)
def _disk_kernel(radius: float, supersample: int = 8):
    """Normalised defocus disk of `radius` px acting on pixel footprints: tap (i, j) is the fraction of
    point pairs (p in the centre pixel, q in pixel (i, j)) with |p − q| ≤ radius, so sub-pixel radii blur."""
    import torch

    half = int(np.ceil(radius + 1))
    offsets = (np.arange(supersample) + 0.5) / supersample - 0.5
    py, px = [a.ravel() for a in np.meshgrid(offsets, offsets, indexing="ij")]
    taps = np.zeros((2 * half + 1, 2 * half + 1))
    for row in range(-half, half + 1):
        for col in range(-half, half + 1):
            dy = (row + py)[:, None] - py[None, :]
            dx = (col + px)[:, None] - px[None, :]
            taps[row + half, col + half] = np.mean(dy ** 2 + dx ** 2 <= radius ** 2)
    return torch.tensor(taps / taps.sum(), dtype=torch.float32)


def _line_kernel(length: float, angle: float, supersample: int = 64):
    """Normalised line of `length` px through the centre at `angle`, splatted bilinearly."""
    import torch

    half = int(np.ceil(length / 2)) + 1
    t = np.linspace(-length / 2, length / 2, supersample)
    x, y = half + t * np.cos(angle), half + t * np.sin(angle)
    x0, y0 = np.floor(x).astype(int), np.floor(y).astype(int)
    fx, fy = x - x0, y - y0
    taps = np.zeros((2 * half + 1, 2 * half + 1))
    for dy, wy in ((0, 1 - fy), (1, fy)):
        for dx, wx in ((0, 1 - fx), (1, fx)):
            np.add.at(taps, (y0 + dy, x0 + dx), wy * wx)
    return torch.tensor(taps / taps.sum(), dtype=torch.float32)


def _smooth_field(noise, sigma: float):
    """Gaussian smoothing (σ px, reflect edges) of a [K, H, W] field, then unit std per map."""
    import torch
    import torch.nn.functional as F

    radius = int(np.ceil(3 * sigma))
    xs = torch.arange(-radius, radius + 1, dtype=torch.float32)
    g = torch.exp(-xs ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    field = noise.unsqueeze(1)
    pad = min(radius, field.shape[-1] - 1)
    field = F.pad(field, (pad, pad, pad, pad), mode="reflect")
    if pad < radius:  # tiny images: zero-extend beyond the reflectable border
        field = F.pad(field, (radius - pad,) * 4)
    field = F.conv2d(field, g.view(1, 1, 1, -1))
    field = F.conv2d(field, g.view(1, 1, -1, 1))[:, 0]
    return field / field.flatten(1).std(dim=1).clamp_min(1e-8).view(-1, 1, 1)


def _corrupt_one(x, kind: str, level: float, rng: np.random.Generator, donor):
    import torch
    import torch.nn.functional as F

    channels, height, width = x.shape

    def normal(*shape):
        return torch.tensor(rng.standard_normal(shape), dtype=torch.float32)

    def uniform(*shape):
        return torch.tensor(rng.random(shape), dtype=torch.float32)

    if kind == "gaussian_noise":
        return x + level * normal(*x.shape)
    if kind == "shot_noise":
        return torch.tensor(rng.poisson(level * x.numpy()) / level, dtype=torch.float32)
    if kind == "impulse_noise":
        hit = uniform(*x.shape) < level
        salt = uniform(*x.shape) < 0.5
        return torch.where(hit, salt.float(), x)
    if kind == "speckle_noise":
        return x + x * level * normal(*x.shape)
    if kind == "contrast":
        mean = x.mean(dim=(1, 2), keepdim=True)
        return (x - mean) * level + mean
    if kind == "fog":
        field = F.interpolate(uniform(1, 1, 4, 4), size=(height, width), mode="bilinear", align_corners=False)[0]
        return (1 - level) * x + level * (0.3 + field)
    if kind == "pixelate":  # s×s blocks (spec sizes are for 16 px) on a random grid phase, block means
        blocks = level * min(height, width) / 16
        phase = rng.uniform(0, height / blocks, size=2)
        by = np.floor((np.arange(height) + phase[0]) * blocks / height).astype(int)
        bx = np.floor((np.arange(width) + phase[1]) * blocks / width).astype(int)
        cell = torch.tensor(by[:, None] * (bx.max() + 1) + bx[None, :]).flatten()
        flat = x.flatten(1)
        sums = torch.zeros(channels, int(cell.max()) + 1).index_add_(1, cell, flat)
        counts = torch.zeros(int(cell.max()) + 1).index_add_(0, cell, torch.ones(len(cell)))
        return (sums / counts.clamp_min(1))[:, cell].view_as(x)
    if kind == "vertical_lines":
        lines = torch.tensor(rng.random(width) < level)
        values = torch.tensor(rng.uniform(0.5, 1.0, width), dtype=torch.float32)
        return torch.where(lines.view(1, 1, -1), values.view(1, 1, -1).expand_as(x), x)
    if kind == "luminance_checkerboard":
        oy, ox = rng.integers(0, 8, size=2)  # a random phase of the 4-px board
        ys = (torch.arange(height) + int(oy)) // 4
        xs = (torch.arange(width) + int(ox)) // 4
        board = ((ys.view(-1, 1) + xs.view(1, -1)) % 2).float() * 2 - 1  # ±1
        return x + level * board
    if kind == "stickers":
        out = x.clone()
        for _ in range(int(level)):
            source = donor(rng)
            sy, sx = rng.integers(0, height - 3), rng.integers(0, width - 3)
            ty, tx = rng.integers(0, height - 3), rng.integers(0, width - 3)
            out[:, ty:ty + 4, tx:tx + 4] = source[:, sy:sy + 4, sx:sx + 4]
        return out
    if kind == "mosaic":
        out = x.clone()
        source = donor(rng)
        tiles = [(r, c) for r in range(0, height - 3, 4) for c in range(0, width - 3, 4)]
        chosen = rng.choice(len(tiles), size=int(round(level * len(tiles))), replace=False)
        for k in chosen:
            r, c = tiles[k]
            out[:, r:r + 4, c:c + 4] = source[:, r:r + 4, c:c + 4]
        return out
    raise ValueError(f"unknown corruption '{kind}'; valid: {', '.join(CORRUPTIONS)}")


def corrupt(images, kind: str, severity: int, seed: int, ids=None):
    """Corrupt every image of [N, C, H, W] with `kind` at `severity` (1–5); clipped to [0, 1].

    ids[i] (default i) names image i in the seed; donor types take other images of `images`.
    """
    import torch

    if kind not in PARAMS:
        raise ValueError(f"unknown corruption '{kind}'; valid: {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1–5, not {severity}")
    level = PARAMS[kind][severity - 1]
    ids = np.arange(len(images)) if ids is None else np.asarray(ids)
    if kind in BATCHED:  # per-image draws, one batched tensor op
        rngs = [image_rng(seed, kind, severity, i) for i in ids]
        return BATCHED[kind](images, level, rngs).clamp(0, 1)
    out = torch.empty_like(images)
    for i in range(len(images)):
        rng = image_rng(seed, kind, severity, ids[i])

        def donor(generator, i=i):  # another image of the set, never the image itself
            j = (i + 1 + int(generator.integers(0, max(len(images) - 1, 1)))) % len(images)
            return images[j]

        out[i] = _corrupt_one(images[i], kind, level, rng, donor)
    return out.clamp(0, 1)


def _defocus_batch(images, radius: float, rngs):
    return _convolve_each(images, _disk_kernel(radius).expand(len(images), -1, -1))


def _motion_batch(images, length: float, rngs):
    import torch

    return _convolve_each(images, torch.stack([_line_kernel(length, rng.uniform(0, np.pi)) for rng in rngs]))


def _elastic_batch(images, alpha: float, rngs):
    import torch

    _, _, height, width = images.shape
    noise = torch.tensor(np.stack([rng.standard_normal((2, height, width)) for rng in rngs]), dtype=torch.float32)
    field = _smooth_field(noise.flatten(0, 1), sigma=2.0).view_as(noise) * alpha
    return _warp_each(images, field[:, 0], field[:, 1])


def _convolve_each(images, kernels):
    """Image i convolved with kernels[i] (same-size output, edges replicated): one grouped conv."""
    import torch.nn.functional as F

    n, channels, height, width = images.shape
    pad = kernels.shape[-1] // 2
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate").reshape(1, n * channels, height + 2 * pad,
                                                                          width + 2 * pad)
    weight = kernels.repeat_interleave(channels, dim=0).unsqueeze(1).contiguous()
    return F.conv2d(padded, weight, groups=n * channels).view(n, channels, height, width)


def _warp_each(images, dx, dy):
    """Resample image i at (x + dx[i], y + dy[i]) (pixels), bilinear, zero outside."""
    import torch
    import torch.nn.functional as F

    _, _, height, width = images.shape
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float32), torch.arange(width, dtype=torch.float32),
                            indexing="ij")
    grid = torch.stack([(xs + dx + 0.5) / width * 2 - 1, (ys + dy + 0.5) / height * 2 - 1], dim=-1)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


BATCHED = {"defocus_blur": _defocus_batch, "motion_blur": _motion_batch, "elastic": _elastic_batch}


def benchmark_of(kind: str) -> str:
    for name, kinds in BENCHMARKS.items():
        if kind in kinds:
            return name
    return "shift_data"  # a type of a user --shift-data folder


# user folders ---------------------------------------------------------------------------------
def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def read_image(path: Path, size: int, channels: int):
    """One file → float32 [C, size, size] in [0, 1] (grey or RGB, bilinear resize)."""
    import torch
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image = image.convert("L" if channels == 1 else "RGB").resize((size, size), Image.BILINEAR)
            array = np.asarray(image, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageDataError(f"image '{path}' cannot be read ({type(exc).__name__}); "
                             "replace or delete the file") from None
    tensor = torch.from_numpy(array.copy())
    return tensor.unsqueeze(0) if channels == 1 else tensor.permute(2, 0, 1)


def _class_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read_classes(folder: Path, classes: list[str], size: int, channels: int) -> Split:
    import torch

    images, labels = [], []
    for label, name in enumerate(classes):
        sub = folder / name
        for path in (_image_files(sub) if sub.is_dir() else []):
            images.append(read_image(path, size, channels))
            labels.append(label)
    if not images:
        raise ImageDataError(f"'{folder}' holds no images ({', '.join(IMAGE_EXTENSIONS)}) in class subfolders; "
                             "put them in <class>/<file>")
    return Split(torch.stack(images), torch.tensor(labels, dtype=torch.int64))


def _folder_layout(folder: Path) -> tuple[dict[str, Path] | None, list[str]]:
    """(train/val/test folders, or None for one folder to split; the class names) of a user image folder."""
    if not folder.is_dir():
        raise ImageDataError(f"--data '{folder}' is not a directory; pass a folder of <class>/<image> files")
    split_dirs = {name: folder / name for name in ("train", "val", "test")}
    if all(d.is_dir() for d in split_dirs.values()):
        classes = [p.name for p in _class_folders(split_dirs["train"])]
        if len(classes) < 2:
            raise ImageDataError(f"'{split_dirs['train']}' needs at least two class subfolders")
        return split_dirs, classes
    classes = [p.name for p in _class_folders(folder)]
    if len(classes) < 2:
        raise ImageDataError(f"--data '{folder}' needs at least two class subfolders (or train/ val/ test/ "
                             "subfolders of them)")
    return None, classes


def check_image_folder(folder: str | Path) -> None:
    """What `load_image_folder` would refuse, found before a run starts: the layout, and the first image of
    every class of every split read as the run reads it (the run then reads them all)."""
    folder = Path(folder)
    split_dirs, classes = _folder_layout(folder)
    for root in (split_dirs or {"": folder}).values():
        firsts = [files[0] for files in (_image_files(root / c) if (root / c).is_dir() else [] for c in classes)
                  if files]
        if not firsts:
            raise ImageDataError(f"'{root}' holds no images ({', '.join(IMAGE_EXTENSIONS)}) in class subfolders; "
                                 "put them in <class>/<file>")
        for path in firsts:
            read_image(path, 8, 1)


def load_image_folder(folder: str | Path, size: int, channels: int, seed: int,
                      fractions: tuple[float, float] = (0.6, 0.15)) -> tuple[dict[str, Split], list[str]]:
    """A class-subfolder image folder → ({train, val, test}, class names).

    With train/ val/ test/ subfolders they are the splits; otherwise a seeded stratified split
    (60/15/25 %)."""
    import torch
    from sklearn.model_selection import train_test_split

    folder = Path(folder)
    split_dirs, classes = _folder_layout(folder)
    if split_dirs is not None:
        return {name: _read_classes(d, classes, size, channels) for name, d in split_dirs.items()}, classes
    everything = _read_classes(folder, classes, size, channels)
    labels = everything.labels.numpy()
    if np.bincount(labels, minlength=len(classes)).min() < 4:
        raise ImageDataError(f"--data '{folder}': every class needs at least 4 images for a stratified "
                             "train/val/test split; add images or give train/ val/ test/ subfolders")
    index = np.arange(len(labels))
    rest, test = train_test_split(index, test_size=1 - sum(fractions), stratify=labels, random_state=seed)
    train, val = train_test_split(rest, test_size=fractions[1] / sum(fractions), stratify=labels[rest],
                                  random_state=seed)
    return {name: Split(everything.images[torch.as_tensor(idx)], everything.labels[torch.as_tensor(idx)])
            for name, idx in (("train", train), ("val", val), ("test", test))}, classes


@dataclass
class ShiftData:
    """A --shift-data folder: unlabelled images (`pool`) or labelled (type, severity) test sets."""

    pool: object | None = None  # torch.Tensor [N, C, H, W] of unlabelled images
    sets: dict | None = None  # (type, severity) -> Split


def load_shift_folder(folder: str | Path, size: int, channels: int, classes: list[str]) -> ShiftData:
    """Unlabelled images anywhere below `folder`, or the ImageNet-C layout <type>/<severity>/<class>/*
    (severity folders named 1–5, class folders named as the clean data's classes)."""
    import torch

    folder = Path(folder)
    if not folder.is_dir():
        raise ImageDataError(f"--shift-data '{folder}' is not a directory; pass a folder of images or "
                             "<type>/<severity>/<class>/<image>")
    types = _class_folders(folder)
    layered = bool(types) and all(any(s.is_dir() and s.name.isdigit() for s in t.iterdir()) for t in types)
    if not layered:
        files = _image_files(folder)
        if not files:
            raise ImageDataError(f"--shift-data '{folder}' holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        return ShiftData(pool=torch.stack([read_image(p, size, channels) for p in files]))
    sets = {}
    for type_dir in types:
        for severity_dir in sorted(p for p in type_dir.iterdir() if p.is_dir()):
            if not severity_dir.name.isdigit() or not 1 <= int(severity_dir.name) <= 5:
                raise ImageDataError(f"'{severity_dir}' is not a severity folder 1–5 "
                                     "(layout <type>/<severity>/<class>/<image>)")
            unknown = [p.name for p in _class_folders(severity_dir) if p.name not in classes]
            if unknown:
                raise ImageDataError(f"'{severity_dir}' has classes {unknown} not in the clean data "
                                     f"({', '.join(classes)}); use the same class folder names")
            sets[(type_dir.name, int(severity_dir.name))] = _read_classes(severity_dir, classes, size, channels)
    return ShiftData(sets=sets)
