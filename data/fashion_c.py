"""Fashion-MNIST-C: the corruption families of ImageNet-C / MNIST-C that make sense at 28×28, five severities
each, with a held-out split of types, for the real-image presets (Fashion-MNIST, `data/idx.py`).

- `corrupt(images, kind, severity, seed, ids)`: float32 [N, C, H, W] in [0, 1] → the same, clipped to
  [0, 1]; the signature and the guarantees of `images.corrupt` (digits_c): every random draw of image i
  comes from the generator of (seed, type, severity, ids[i]), so results never depend on batch order or
  batch size.
- `FASHION_C` (the types, whose order fixes each type's id in the seed), `SEEN`, `HELDOUT`, `PARAMS`.

A module of its own rather than more types in `images.py`: `images.corrupt` keys its parameters by type
name and the default presets iterate over `images.CORRUPTIONS`, so the same names with 28-px parameters (and
two new types) there would change the digits_c runs; here digits_c stays bit-identical, and the shared
helpers (the blur kernels and batched blurs, the per-image noise/contrast/pixelate code of
`images._corrupt_one`) are imported, not copied. Fog's smoothing is `images._smooth_field`'s operator written
as a matrix (see `_fog_batch` for why).

The parameters and the reason for each are beside `PARAMS`. Where a parameter is an intensity or a fraction
of pixels (noises, contrast, brightness, pixelate's resolution factor) it does not depend on the image size
and ImageNet-C's value is kept; where it is a length in pixels (blurs) or acts on a fixed pixel grid (JPEG's
8×8 blocks, fog's octaves) it is rescaled for 28 px.
"""
from __future__ import annotations

import io
from functools import lru_cache

import numpy as np

from icml.data import images as img
from icml.data.images import SEVERITIES

BENCHMARK = "fashion_c"
FASHION_C = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "motion_blur", "contrast",
             "brightness", "fog", "pixelate", "jpeg_compression")
# Held out (never in an unlabelled pool or a tuning set): one type per ImageNet-C family (noise, weather,
# digital) whose errors differ in kind, not only in size, from every seen type:
# - impulse_noise: sparse errors saturated to 0 or 1 (heavy-tailed); the seen noises (Gaussian, shot) are
#   dense, zero-mean and small at every pixel.
# - fog: an additive field correlated over 2–8 px, i.e. at the scale of the garment's parts; no seen type
#   adds spatial structure (the noises are i.i.d. per pixel, brightness and contrast are spatially constant).
# - jpeg_compression: 8×8-block DCT quantisation, with blocking and ringing next to edges; pixelate is blocky
#   too but averages within a block, never rings, and does not depend on the block's frequencies.
# The blur family stays seen (defocus and motion are both low-pass filters, one isotropic, one oriented),
# so the held-out set tests extrapolation in kind across three families rather than within one.
HELDOUT = ("impulse_noise", "fog", "jpeg_compression")
SEEN = tuple(k for k in FASHION_C if k not in HELDOUT)
RANDOM = ("gaussian_noise", "shot_noise", "impulse_noise", "motion_blur", "fog", "pixelate")  # draw per image
TYPE_ID_OFFSET = 100  # the type's id in the seed: 100 + index, apart from digits_c's 0–13 in images.image_rng

# severity 1→5 parameters for 28×28 (ImageNet-C's are for 224 px, the digits suite's for 16 px)
PARAMS = {
    # σ of additive N(0, σ²) per pixel: ImageNet-C's. An intensity per pixel does not depend on the pixel
    # count, and Fashion-MNIST is in the same [0, 1] range.
    "gaussian_noise": (.08, .12, .18, .26, .38),
    # photon budget c of Poisson(c·x)/c: ImageNet-C's, for the same reason (a count per pixel).
    "shot_noise": (60, 25, 12, 5, 3),
    # fraction of pixels set to 0 or 1 (half each): ImageNet-C's; a fraction of pixels is size-free.
    "impulse_noise": (.03, .06, .09, .17, .27),
    # defocus disk radius in px: ImageNet-C's 3, 4, 6, 8, 10 px × 0.2. The geometric factor 28/224 = 0.125
    # gives 0.375 px at severity 1, which barely mixes neighbouring pixels of an image whose thinnest parts
    # (straps, soles, sleeve gaps) are 1–2 px wide; 0.2 keeps ImageNet-C's 3:4:6:8:10 progression from just
    # over half a pixel (neighbours start to mix) to a 2-px radius (a 5-px disk, ~1/6 of the image, where
    # sleeves and straps merge into the body).
    "defocus_blur": (0.6, 0.8, 1.2, 1.6, 2.0),
    # motion line length in px (random direction per image): ImageNet-C's kernel σ 3, 5, 8, 12, 15 at 224 px
    # × 0.4. The smear of a Gaussian-weighted line is ~2σ long, so 28/224 would give σ/4; ×1.6 more, the same
    # lift as defocus (0.2 / 0.125), so that severity 1 moves energy by a pixel and severity 5 smears over 6 px.
    "motion_blur": (1.2, 2.0, 3.2, 4.8, 6.0),
    # contrast factor c of (x − mean)·c + mean: ImageNet-C's; a ratio of intensities, size-free.
    "contrast": (.4, .3, .2, .1, .05),
    # brightness shift c of clip(x + c): ImageNet-C's HSV value shift, which for grey images is exactly this.
    "brightness": (.1, .2, .3, .4, .5),
    # (blend weight w, octave decay d) of (1 − w)·x + w·fog, fog = Σ_k d^−k · smooth_k rescaled to [0, 1],
    # smooth_k white noise smoothed at σ = 8, 4, 2 px (FOG_SIGMAS). ImageNet-C's plasma fractal blends in
    # with w = c/(1 + c) = .6–.75 and decay d = 2, 2, 1.7, 1.5, 1.4 (rougher as severity grows); its octaves
    # run down to 1 px on 224 px, far below the object's scale. At 28 px the three octaves kept are all at
    # the scale of the garment's parts, so the same w would erase the shape at severity 1: w starts at .3
    # (70 % of the image's contrast kept) and rises by .1 to .7, close to ImageNet-C's .75 at severity 5;
    # d is ImageNet-C's.
    "fog": ((.3, 2.0), (.4, 2.0), (.5, 1.7), (.6, 1.5), (.7, 1.4)),
    # resolution factor c (box-average blocks of 1/c px: 28·c blocks across, on a random grid phase):
    # ImageNet-C's; a ratio of resolutions is size-free (blocks of 1.7–4 px, 16.8–7 blocks across).
    "pixelate": (.6, .5, .4, .3, .25),
    # Pillow JPEG quality. ImageNet-C's 25, 18, 15, 10, 7 scale the IJG quantiser steps by 2, 2.8, 3.3, 5,
    # 7.1; but JPEG's 8×8 block is a fixed pixel grid that covers 29 % of a 28-px image's width against
    # 3.6 % at 224 px, so each quantised coefficient carries shape, not texture. The steps are halved
    # (×1, 1.4, 1.7, 2.5, 3.6 of the standard table), i.e. qualities 50, 36, 30, 20, 14: mean |error| on
    # the t10k images .023 → .045, against ImageNet-C's qualities' .033 → .054.
    "jpeg_compression": (50, 36, 30, 20, 14),
}
FOG_SIGMAS = (8.0, 4.0, 2.0)  # fog's octaves in px: image scale (28 px ≈ 3.5σ), garment parts, their edges


def image_rng(seed: int, kind: str, severity: int, image_id: int) -> np.random.Generator:
    """The generator of one corrupted image: (seed, type, severity, id), nothing else (as images.image_rng)."""
    return np.random.default_rng([seed, TYPE_ID_OFFSET + FASHION_C.index(kind), severity, int(image_id)])


def corrupt(images, kind: str, severity: int, seed: int, ids=None):
    """Corrupt every image of [N, C, H, W] (float, [0, 1]) with `kind` at `severity` (1–5); clipped to [0, 1].

    ids[i] (default i) names image i in the seed, so a subset corrupted with its ids equals the same rows of
    the whole set corrupted."""
    import torch

    if kind not in PARAMS:
        raise ValueError(f"unknown Fashion-MNIST-C corruption '{kind}'; valid: {', '.join(FASHION_C)}")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be 1–5, not {severity}")
    level = PARAMS[kind][severity - 1]
    ids = np.arange(len(images)) if ids is None else np.asarray(ids)
    if len(ids) != len(images):
        raise ValueError(f"{len(ids)} ids for {len(images)} images")
    if len(images) == 0:
        return images.clone()
    # the deterministic types (defocus, contrast, brightness, JPEG) draw nothing: no generator to build
    rngs = [image_rng(seed, kind, severity, i) for i in ids] if kind in RANDOM else [None] * len(ids)
    if kind in _BATCHED:
        return _BATCHED[kind](images, level, rngs).clamp(0, 1)
    if kind == "pixelate":  # images._corrupt_one counts blocks per 16 px: c·H blocks across is 16·c per 16 px
        level = 16 * level
    return torch.stack([img._corrupt_one(x, kind, level, rng, None) for x, rng in zip(images, rngs)]).clamp(0, 1)


def _brightness_batch(images, shift: float, rngs):
    return images + shift


@lru_cache(maxsize=None)
def _smoothing_matrix(size: int, sigma: float) -> np.ndarray:
    """S [size, size] with S @ v = v Gaussian-smoothed (σ px, reflected edges, zero past one reflection): the
    1-D operator of images._smooth_field as a matrix, so a field is smoothed by S @ noise @ S.T."""
    radius = int(np.ceil(3 * sigma))
    taps = np.exp(-np.arange(-radius, radius + 1) ** 2 / (2 * sigma ** 2))
    taps /= taps.sum()
    matrix = np.zeros((size, size))
    for i in range(size):
        for offset, weight in zip(range(-radius, radius + 1), taps):
            j = i + offset
            j = -j if j < 0 else 2 * (size - 1) - j if j >= size else j
            if 0 <= j < size:
                matrix[i, j] += weight
    return matrix


def _fog_batch(images, level, rngs):
    """(1 − w)·x + w·fog, fog = Σ_k d^−k · (white noise smoothed at FOG_SIGMAS[k], unit std), rescaled to [0, 1]
    per image. The smoothing is images._smooth_field's, done as float64 matrix products rather than with
    conv2d: conv2d's result for an image may depend on the batch around it (a batch of one takes another
    kernel path), and a corruption must not; numpy's stacked matmul treats each image on its own."""
    import torch

    weight, decay = level
    n, _, height, width = images.shape
    noise = np.stack([rng.standard_normal((len(FOG_SIGMAS), height, width)) for rng in rngs])
    fog = np.zeros((n, height, width))
    for k, sigma in enumerate(FOG_SIGMAS):
        field = _smoothing_matrix(height, sigma) @ noise[:, k] @ _smoothing_matrix(width, sigma).T
        fog += decay ** -k * field / np.maximum(field.reshape(n, -1).std(axis=1), 1e-8)[:, None, None]
    low, high = fog.min(axis=(1, 2), keepdims=True), fog.max(axis=(1, 2), keepdims=True)
    fog = (fog - low) / np.maximum(high - low, 1e-8)
    return (1 - weight) * images + weight * torch.from_numpy(fog).float().unsqueeze(1)  # every channel alike


def _jpeg_batch(images, quality: int, rngs):
    """Each image through Pillow's JPEG encoder and decoder at `quality` (grey per channel, or RGB)."""
    import torch
    from PIL import Image

    def roundtrip(array: np.ndarray, mode: str) -> np.ndarray:
        buffer = io.BytesIO()
        Image.fromarray(array, mode).save(buffer, format="JPEG", quality=int(quality))
        buffer.seek(0)
        with Image.open(buffer) as decoded:
            return np.asarray(decoded.convert(mode))

    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    out = np.empty_like(pixels)
    for i, image in enumerate(pixels):
        if image.shape[0] == 3:
            out[i] = roundtrip(np.ascontiguousarray(image.transpose(1, 2, 0)), "RGB").transpose(2, 0, 1)
        else:
            out[i] = np.stack([roundtrip(np.ascontiguousarray(channel), "L") for channel in image])
    return torch.from_numpy(out).float() / 255


_BATCHED = {"defocus_blur": img._defocus_batch, "motion_blur": img._motion_batch, "brightness": _brightness_batch,
            "fog": _fog_batch, "jpeg_compression": _jpeg_batch}
