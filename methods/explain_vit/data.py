"""Data: seeded synthetic objects on clutter with ground-truth masks and boxes, 2×2 montages, and a loader
for a user's folder of images (optional `<stem>_mask.png` masks and a `labels.csv`).

Images are float32 RGB in [0, 1], shape (n, 3, H, W); the model's normalisation happens later.
"""
from __future__ import annotations

import colorsys
import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CLASSES = ["disk", "square", "triangle", "cross", "ring", "bar_pair"]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
SUPERSAMPLE = 4  # sub-pixel samples per axis for anti-aliased shapes


@dataclass
class ImageSet:
    images: np.ndarray  # (n, 3, H, W) float32 in [0, 1]
    labels: np.ndarray  # (n,) int64; -1 when unknown
    masks: np.ndarray | None  # (n, H, W) bool, or None
    boxes: np.ndarray | None  # (n, 4) int64 x0, y0, x1, y1 (inclusive), or None
    ids: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index) -> "ImageSet":
        index = np.asarray(index, dtype=np.int64)
        return ImageSet(self.images[index], self.labels[index],
                        None if self.masks is None else self.masks[index],
                        None if self.boxes is None else self.boxes[index], [self.ids[i] for i in index])


@dataclass
class MontageSet:
    images: np.ndarray  # (m, 3, 2H, 2W) or (m, 3, H, W) in downscale mode
    classes: np.ndarray  # (m, 4) class per cell, row-major: top-left, top-right, bottom-left, bottom-right
    ids: list[str]


def _inside(kind: int, u: np.ndarray, v: np.ndarray, r: float) -> np.ndarray:
    """Membership of points (u, v) in the object's own frame (centred, unrotated), half-size r."""
    au, av = np.abs(u), np.abs(v)
    if kind == 0:  # disk
        return u * u + v * v <= r * r
    if kind == 1:  # square
        return (au <= 0.8 * r) & (av <= 0.8 * r)
    if kind == 2:  # triangle, apex up, base at v = 0.7 r
        return (v <= 0.7 * r) & (v >= -r + 1.7 * au * 1.15)
    if kind == 3:  # cross
        arm = 0.3 * r
        return ((au <= arm) & (av <= r)) | ((av <= arm) & (au <= r))
    if kind == 4:  # ring
        d2 = u * u + v * v
        return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)
    # bar pair: two parallel vertical bars
    return (av <= r) & (au >= 0.3 * r) & (au <= 0.75 * r)


def _texture(rng: np.random.Generator, size: int) -> np.ndarray:
    """A smooth background: a random base colour plus two random sinusoids of amplitude 0.2."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / size
    base = rng.uniform(0.25, 0.75, size=3)
    out = np.repeat(base[:, None, None], size, 1).repeat(size, 2)
    for _ in range(2):
        fx, fy = rng.uniform(0.5, 3.0, size=2) * rng.choice([-1, 1], size=2)
        phase = rng.uniform(0, 2 * np.pi)
        wave = 0.2 * np.sin(2 * np.pi * (fx * xx + fy * yy) + phase)
        out += wave[None] * rng.uniform(0.3, 1.0, size=3)[:, None, None]
    return out


def _clutter(rng: np.random.Generator, image: np.ndarray) -> None:
    """6–12 thin line segments and small dots in random colours (no filled shape of any class)."""
    size = image.shape[-1]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    for _ in range(int(rng.integers(6, 13))):
        colour = rng.uniform(0, 1, size=3)
        if rng.random() < 0.6:  # segment of width ~1 px
            p = rng.uniform(0, size, size=2)
            angle, length = rng.uniform(0, np.pi), rng.uniform(4, 12)
            d = np.array([np.cos(angle), np.sin(angle)])
            rel_x, rel_y = xx - p[0], yy - p[1]
            t = np.clip(rel_x * d[0] + rel_y * d[1], 0, length)
            dist = np.hypot(rel_x - t * d[0], rel_y - t * d[1])
            hit = dist <= 0.5
        else:  # dot of radius ~1 px
            p = rng.uniform(0, size, size=2)
            hit = np.hypot(xx - p[0], yy - p[1]) <= rng.uniform(0.6, 1.2)
        image[:, hit] = colour[:, None]


def make_image(seed: int, split: str, index: int, size: int = 32, label: int | None = None):
    """One image with its object: (image (3,H,W), label, mask (H,W), box), seeded by (seed, split, index)."""
    rng = np.random.default_rng([seed, {"train": 0, "val": 1, "test": 2, "montage": 3}[split], index])
    kind = int(rng.integers(len(CLASSES))) if label is None else int(label)
    image = _texture(rng, size)
    _clutter(rng, image)
    side = rng.uniform(8, 14)
    r = side / 2
    margin = r * 1.5 + 0.5  # the rotated bounding square stays inside the image
    cx, cy = rng.uniform(margin, size - margin, size=2)
    angle = np.deg2rad(rng.uniform(-15, 15))
    sub = (np.arange(size * SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    yy, xx = np.meshgrid(sub, sub, indexing="ij")
    c, s = np.cos(angle), np.sin(angle)
    u, v = c * (xx - cx) + s * (yy - cy), -s * (xx - cx) + c * (yy - cy)
    cover = _inside(kind, u, v, r).reshape(size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(1, 3))
    hue, sat, val = rng.uniform(0, 1), rng.uniform(0.5, 1), rng.uniform(0.5, 1)
    colour = np.array(colorsys.hsv_to_rgb(hue, sat, val))
    image = np.clip(image * (1 - cover) + colour[:, None, None] * cover, 0, 1)
    mask = cover >= 0.5
    ys, xs = np.nonzero(mask)
    box = np.array([xs.min(), ys.min(), xs.max(), ys.max()])
    return image.astype(np.float32), kind, mask, box


def synthetic(seed: int, split: str, n: int, size: int = 32, offset: int = 0) -> ImageSet:
    parts = [make_image(seed, split, offset + i, size) for i in range(n)]
    return ImageSet(np.stack([p[0] for p in parts]), np.array([p[1] for p in parts], dtype=np.int64),
                    np.stack([p[2] for p in parts]), np.stack([p[3] for p in parts]).astype(np.int64),
                    [f"{split}{offset + i:05d}" for i in range(n)])


def make_montages(cells: ImageSet, n: int, seed: int, mode: str = "interpolate", tag: str = "m") -> MontageSet:
    """n 2×2 grids of four distinct classes drawn from `cells` (each cell used at most once while possible).
    interpolate: cells at full size (2H×2W); downscale: cells average-pooled ×2 onto an H×W canvas."""
    rng = np.random.default_rng([seed, 7])
    by_class = {c: list(rng.permutation(np.nonzero(cells.labels == c)[0])) for c in np.unique(cells.labels)}
    present = [c for c, idx in by_class.items() if idx]
    if len(present) < 4:
        return MontageSet(np.zeros((0, 3, 1, 1), np.float32), np.zeros((0, 4), np.int64), [])
    images, classes = [], []
    cursor = {c: 0 for c in present}
    for _ in range(n):
        chosen = rng.choice(present, size=4, replace=False)
        tiles = []
        for c in chosen:
            pool = by_class[c]
            tiles.append(cells.images[pool[cursor[c] % len(pool)]])
            cursor[c] += 1
        if mode == "downscale":
            h, w = tiles[0].shape[1:]
            tiles = [t.reshape(3, h // 2, 2, w // 2, 2).mean(axis=(2, 4)) for t in tiles]
        top, bottom = np.concatenate(tiles[:2], axis=2), np.concatenate(tiles[2:], axis=2)
        images.append(np.concatenate([top, bottom], axis=1))
        classes.append(chosen)
    return MontageSet(np.stack(images).astype(np.float32), np.array(classes, dtype=np.int64),
                      [f"{tag}{i:04d}" for i in range(n)])


# user folders -------------------------------------------------------------------------------------
def read_image(path: Path) -> np.ndarray:
    """An image file as float32 RGB (3, H, W) in [0, 1]; a clear error for a corrupt file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"image '{path}' cannot be read ({exc.__class__.__name__}); "
                         "pass PNG/JPEG files") from None


def resize(image: np.ndarray, size: int) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    if image.shape[1:] == (size, size):
        return image
    return F.interpolate(torch.from_numpy(image)[None], size=(size, size), mode="bilinear",
                         align_corners=False, antialias=True)[0].numpy()


def _read_labels(path: Path, classes: list[str]) -> dict[str, tuple[int, np.ndarray | None]]:
    """labels.csv: columns file,label[,x0,y0,x1,y1]; label is a class index or a class name."""
    out = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"file", "label"} <= set(reader.fieldnames):
            raise ValueError(f"'{path}' needs a header with columns file,label[,x0,y0,x1,y1]")
        for n, row in enumerate(reader, start=2):
            label = row["label"].strip()
            if label.lstrip("-").isdigit():
                index = int(label)
            elif label in classes:
                index = classes.index(label)
            else:
                raise ValueError(f"'{path}' line {n}: label '{label}' is neither a class index nor one of the "
                                 f"model's class names")
            box = None
            if all(row.get(k) not in (None, "") for k in ("x0", "y0", "x1", "y1")):
                box = np.array([float(row[k]) for k in ("x0", "y0", "x1", "y1")])
            out[Path(row["file"]).stem] = (index, box)
    return out


def load_folder(folder: str | Path, size: int, classes: list[str]) -> ImageSet:
    """Every image in `folder` resized to size×size; masks from `<stem>_mask.png`, labels and boxes (in the
    original image's pixels) from `labels.csv`. Boxes are rescaled; a mask gives a box when the CSV has none."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.stem.endswith("_mask"))
    if not files:
        raise ValueError(f"data folder '{folder}' holds no images ({', '.join(IMAGE_SUFFIXES)})")
    labels = _read_labels(folder / "labels.csv", classes) if (folder / "labels.csv").is_file() else {}
    images, ys, masks, boxes = [], [], [], []
    for path in files:
        raw = read_image(path)
        h, w = raw.shape[1:]
        images.append(resize(raw, size))
        label, box = labels.get(path.stem, (-1, None))
        ys.append(label)
        mask_path = path.with_name(f"{path.stem}_mask.png")
        mask = resize(read_image(mask_path).mean(0, keepdims=True).repeat(3, 0), size)[0] >= 0.5 \
            if mask_path.is_file() else None
        masks.append(mask)
        if box is not None:
            box = np.round(box * np.array([size / w, size / h, size / w, size / h])).clip(0, size - 1)
        elif mask is not None and mask.any():
            yy, xx = np.nonzero(mask)
            box = np.array([xx.min(), yy.min(), xx.max(), yy.max()])
        boxes.append(box)
    has_masks = all(m is not None for m in masks)
    has_boxes = all(b is not None for b in boxes)
    return ImageSet(np.stack(images).astype(np.float32), np.array(ys, dtype=np.int64),
                    np.stack(masks) if has_masks else None,
                    np.stack(boxes).astype(np.int64) if has_boxes else None, [p.stem for p in files])


# Fashion-MNIST (the real preset) ----------------------------------------------------------------------
def fashion_mnist(path: str | None, seed: int, n_train: int, n_val: int, n_test: int,
                  foreground: float = 0.05) -> dict[str, ImageSet]:
    """Fashion-MNIST through the project's loader (`data/idx.py`: Debian's package when `path` is None) as
    ImageSets of grey replicated to RGB: train (the first n_train of the seeded stratified rest of train), val (a
    seeded stratified n_val of train: the α_max montages), test (the first n_test t10k images) and montage (the
    other t10k images, cells of the test montages, never explained singly). Fashion-MNIST has no annotated objects:
    the mask is the silhouette, pixel > `foreground` (the background is black), and the box its tight box.
    Train images are a torch view expanded to 3 channels (no copy of 55k × 3 channels; `train_classifier` takes
    it), without masks."""
    from icml.data.idx import fashion_mnist_splits

    splits = fashion_mnist_splits(path, val=n_val, seed=seed)
    train, val, test = splits["train"], splits["val"], splits["test"]

    def image_set(images, labels, name: str, index: np.ndarray, masks: bool = True) -> ImageSet:
        ids = [f"{name}{i:05d}" for i in index]
        if not masks:
            return ImageSet(images.expand(-1, 3, -1, -1), labels.numpy().astype(np.int64), None, None, ids)
        grey = images.numpy()  # (n, 1, 28, 28) float32 in [0, 1]
        mask = grey[:, 0] > foreground
        cols, rows = mask.any(1), mask.any(2)  # (n, W), (n, H): a column / row holds foreground
        side = mask.shape[1] - 1
        first = lambda a: np.where(a.any(1), a.argmax(1), 0)  # noqa: E731 — an empty mask's box is the image
        last = lambda a: np.where(a.any(1), side - a[:, ::-1].argmax(1), side)  # noqa: E731
        boxes = np.stack([first(cols), first(rows), last(cols), last(rows)], 1).astype(np.int64)
        return ImageSet(np.repeat(grey, 3, axis=1), labels.numpy().astype(np.int64), mask, boxes, ids)

    n_train = min(n_train, len(train))
    rest = np.arange(n_test, len(test))
    return {"train": image_set(train.images[:n_train], train.labels[:n_train], "train", np.arange(n_train), False),
            "val": image_set(val.images, val.labels, "val", np.arange(len(val))),
            "test": image_set(test.images[:n_test], test.labels[:n_test], "t10k-", np.arange(n_test)),
            "montage": image_set(test.images[n_test:], test.labels[n_test:], "t10k-", rest)}
