"""Short videos: a deterministic moving-sprite generator and a loader for a folder of user clips.

A clip is T frames of H×W RGB in [−1, 1], stored as a float32 array (T, H, W, 3). Clips shorter
than T are padded by repeating their last valid frame; `valid` (T,) marks the real frames, so a
consumer can keep padded frames out of losses and masks.

Generator (pure numpy, everything from one seed):
- appearance: a sprite `shape` (square | disk | cross, 4–5 px), a `hue` index into 6 base hues
  (±10% jitter), a `background` (flat | stripes | checker | noise) with a random phase;
- motion: static | right | down | diagonal | orbit | bounce | jitter at 1–2 px/frame, rendered
  anti-aliased at sub-pixel positions, independent of the appearance;
- camera pan: the background translates 1–2 px/frame while the sprite stays fixed in frame;
- analytic flow (T, 2, H, W): the displacement of each pixel to the next frame (sprite
  displacement on sprite pixels, pan displacement on background pixels, 0 elsewhere; the last
  valid frame and padded frames are 0, as if the last frame were repeated).

`make_clip(spec)` renders one `ClipSpec`; `random_spec(rng, …)` draws one; the callers (methods)
compose sets from specs. `load_clip_folder(path, …)` reads user clips: `.npy`/`.npz` arrays
(T, H, W, 3) uint8 or folders of PNG frames, plus `captions.csv` (clip_id, prompt_id, split).
Every malformed input raises `VideoDataError` with one line naming the file and the problem.
"""
from __future__ import annotations

import colorsys
import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MOTIONS = ("static", "right", "down", "diagonal", "orbit", "bounce", "jitter")
SHAPES = ("square", "disk", "cross")
BACKGROUNDS = ("flat", "stripes", "checker", "noise")
N_HUES = 6
N_PROMPTS = len(MOTIONS) * len(SHAPES)  # prompt id = motion × shape; id N_PROMPTS is the null prompt
NULL_PROMPT = N_PROMPTS
LENGTHS = (4, 6, 8)
SPLITS = ("pretrain", "pool", "query")


class VideoDataError(ValueError):
    """A clip or caption file that cannot be used (one line: the file and the problem)."""


@dataclass
class ClipSpec:
    """Every factor of a synthetic clip; `make_clip` renders it deterministically."""

    motion: str
    shape: str
    hue: int
    hue_jitter: float  # relative hue shift in [−0.1, 0.1]
    background: str
    bg_seed: int  # phase / noise field of the background
    size: float  # sprite size in px (4–5)
    speed: float  # px per frame (1–2)
    start_x: float
    start_y: float
    direction: float  # bounce heading (radians)
    valid_len: int
    pan: float = 0.0  # camera pan speed in px/frame (0: none)
    pan_angle: float = 0.0
    motion_seed: int = 0  # the i.i.d. jitter offsets
    decoy_type: str = "none"  # none | static | jitter | pan | twin

    @property
    def prompt_id(self) -> int:
        return prompt_id(self.motion, self.shape)


def prompt_id(motion: str, shape: str) -> int:
    return MOTIONS.index(motion) * len(SHAPES) + SHAPES.index(shape)


@dataclass
class Clip:
    frames: np.ndarray  # (T, H, W, 3) float32 in [−1, 1]
    valid: np.ndarray  # (T,) bool
    flow: np.ndarray | None  # (T, 2, H, W) float32 (dx, dy) to the next frame; None: unknown
    prompt_id: int
    factors: dict = field(default_factory=dict)

    @property
    def valid_len(self) -> int:
        return int(self.valid.sum())


# appearance ----------------------------------------------------------------------------------
def sprite_rgb(hue: int, jitter: float) -> np.ndarray:
    h = (hue / N_HUES + jitter / N_HUES) % 1.0  # ±10% of the spacing between base hues
    return np.array(colorsys.hsv_to_rgb(h, 0.9, 0.95), dtype=np.float32)


def _coverage(shape: str, size: float, cx: float, cy: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Anti-aliased sprite coverage in [0, 1] from a signed distance in pixels (centre at cx, cy)."""
    dx, dy = xs - cx, ys - cy
    half = size / 2
    if shape == "square":
        sdf = np.maximum(np.abs(dx), np.abs(dy)) - half
    elif shape == "disk":
        sdf = np.hypot(dx, dy) - half
    else:  # cross: the union of two bars of width size/3
        arm = size / 6
        bar_h = np.maximum(np.abs(dx) - half, np.abs(dy) - arm)
        bar_v = np.maximum(np.abs(dx) - arm, np.abs(dy) - half)
        sdf = np.minimum(bar_h, bar_v)
    return np.clip(0.5 - sdf, 0.0, 1.0)


def _background(kind: str, seed: int, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Background colour at continuous (periodic) coordinates, so a camera pan only shifts it."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.15, 0.45, 3).astype(np.float32)
    other = np.clip(base + rng.uniform(0.15, 0.3), 0, 1).astype(np.float32)
    period = xs.shape[-1]
    if kind == "flat":
        weight = np.zeros_like(xs)
    elif kind == "stripes":
        angle = rng.choice([0.0, np.pi / 2, np.pi / 4])
        phase = rng.uniform(0, 2 * np.pi)
        u = xs * np.cos(angle) + ys * np.sin(angle)
        weight = 0.5 + 0.5 * np.sin(2 * np.pi * u / 4 + phase)
    elif kind == "checker":
        ox, oy = rng.uniform(0, 8, 2)
        weight = 0.5 + 0.5 * np.sin(np.pi * (xs + ox) / 2) * np.sin(np.pi * (ys + oy) / 2)
    else:  # smooth noise: a few random Fourier modes, periodic in the frame size
        weight = np.zeros_like(xs)
        for _ in range(4):
            kx, ky = rng.integers(-2, 3, 2)
            weight += np.cos(2 * np.pi * (kx * xs + ky * ys) / period + rng.uniform(0, 2 * np.pi))
        weight = 0.5 + weight / 8
    return base * (1 - weight[..., None]) + other * weight[..., None]


# motion --------------------------------------------------------------------------------------
def trajectory(spec: ClipSpec, size: int) -> np.ndarray:
    """Sprite centre (valid_len, 2) in px, before padding."""
    n, v = spec.valid_len, spec.speed
    f = np.arange(n, dtype=np.float64)
    x0, y0 = spec.start_x, spec.start_y
    if spec.motion == "static":
        xy = np.stack([np.full(n, x0), np.full(n, y0)], 1)
    elif spec.motion == "right":
        xy = np.stack([x0 + v * f, np.full(n, y0)], 1)
    elif spec.motion == "down":
        xy = np.stack([np.full(n, x0), y0 + v * f], 1)
    elif spec.motion == "diagonal":
        xy = np.stack([x0 + v * f, y0 + v * f], 1)
    elif spec.motion == "orbit":  # radius 4, one revolution over the valid frames
        angle = 2 * np.pi * f / n
        xy = np.stack([x0 + 4 * np.cos(angle), y0 + 4 * np.sin(angle)], 1)
    elif spec.motion == "bounce":  # reflects at the borders of [lo, hi]
        lo, hi = spec.size / 2, size - 1 - spec.size / 2
        raw = np.stack([x0 + v * np.cos(spec.direction) * f, y0 + v * np.sin(spec.direction) * f], 1)
        span = hi - lo
        folded = np.mod(raw - lo, 2 * span)
        xy = lo + np.where(folded > span, 2 * span - folded, folded)
    elif spec.motion == "jitter":  # ±1 px i.i.d. per frame around a fixed centre
        offsets = np.random.default_rng(spec.motion_seed).uniform(-1, 1, (n, 2))
        xy = np.array([x0, y0]) + offsets
    else:
        raise ValueError(f"unknown motion '{spec.motion}'")
    return xy


def make_clip(spec: ClipSpec, frames: int = 8, size: int = 16) -> Clip:
    """Render a spec: frames, validity, analytic flow and factors."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    centres = trajectory(spec, size)
    pan_step = spec.pan * np.array([np.cos(spec.pan_angle), np.sin(spec.pan_angle)])
    colour = sprite_rgb(spec.hue, spec.hue_jitter)
    n = spec.valid_len
    video = np.empty((frames, size, size, 3), np.float32)
    flow = np.zeros((frames, 2, size, size), np.float32)
    for f in range(n):
        shift = pan_step * f  # the scene moves by +shift in the image: sample it at x − shift
        bg = _background(spec.background, spec.bg_seed, xs - shift[0], ys - shift[1])
        cover = _coverage(spec.shape, spec.size, *centres[f], xs, ys)[..., None]
        video[f] = (bg * (1 - cover) + colour * cover) * 2 - 1
        if f + 1 < n:
            on_sprite = cover[..., 0] > 0.5
            sprite_step = centres[f + 1] - centres[f]
            for axis in range(2):
                flow[f, axis] = np.where(on_sprite, sprite_step[axis], pan_step[axis])
    video[n:] = video[n - 1]
    valid = np.arange(frames) < n
    return Clip(video, valid, flow, spec.prompt_id, asdict(spec))


def random_spec(rng: np.random.Generator, motion: str, *, valid_len: int | None = None, frames: int = 8,
                size: int = 16, pan: bool = False, decoy_type: str = "none", appearance: dict | None = None) -> ClipSpec:
    """Draw the factors of one clip with the given motion; `appearance` pins shape/hue/background."""
    n = int(valid_len or rng.choice(LENGTHS))
    n = min(n, frames)
    sprite = float(rng.uniform(4, 5))
    speed = float(rng.uniform(1, 2))
    margin = sprite / 2 + 0.5
    if motion in ("right", "down", "diagonal"):
        speed = min(speed, (size - 2 * margin) / max(n - 1, 1))  # stay in frame for the whole clip
        travel = speed * (n - 1)
        lo, hi = margin, size - 1 - margin - travel
    elif motion == "orbit":
        lo, hi = margin + 4 - 1, size - 1 - margin - 4 + 1
    else:
        lo, hi = margin, size - 1 - margin
    start = rng.uniform(lo, max(lo, hi), 2)
    look = appearance or {}
    return ClipSpec(
        motion=motion,
        shape=look.get("shape", str(rng.choice(SHAPES))),
        hue=int(look.get("hue", rng.integers(N_HUES))),
        hue_jitter=float(look.get("hue_jitter", rng.uniform(-0.1, 0.1))),
        background=look.get("background", str(rng.choice(BACKGROUNDS if not pan else BACKGROUNDS[1:]))),
        bg_seed=int(look.get("bg_seed", rng.integers(2**31))),
        size=sprite, speed=speed, start_x=float(start[0]), start_y=float(start[1]),
        direction=float(rng.uniform(0, 2 * np.pi)), valid_len=n,
        pan=float(rng.uniform(1, 2)) if pan else 0.0, pan_angle=float(rng.uniform(0, 2 * np.pi)),
        motion_seed=int(rng.integers(2**31)), decoy_type=decoy_type)


def appearance_of(spec: ClipSpec) -> dict:
    return {"shape": spec.shape, "hue": spec.hue, "hue_jitter": spec.hue_jitter, "background": spec.background,
            "bg_seed": spec.bg_seed}


def stack(clips: list[Clip]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(videos (N,T,H,W,3), valid (N,T), flow (N,T,2,H,W) with zeros where unknown, prompt ids (N,))."""
    videos = np.stack([c.frames for c in clips])
    valid = np.stack([c.valid for c in clips])
    flow = np.stack([c.flow if c.flow is not None else np.zeros((c.frames.shape[0], 2, *c.frames.shape[1:3]),
                                                                 np.float32) for c in clips])
    return videos, valid, flow, np.array([c.prompt_id for c in clips])


# user clips ----------------------------------------------------------------------------------
def _resize(frames: np.ndarray, size: int) -> np.ndarray:
    """Area/bilinear resize of (T, h, w, 3) to (T, size, size, 3) by separable linear interpolation."""
    t, h, w, _ = frames.shape
    if (h, w) == (size, size):
        return frames

    def axis_weights(n_in: int) -> np.ndarray:
        pos = (np.arange(size) + 0.5) * n_in / size - 0.5
        lo = np.clip(np.floor(pos).astype(int), 0, n_in - 1)
        hi = np.clip(lo + 1, 0, n_in - 1)
        frac = np.clip(pos - np.floor(pos), 0, 1)
        weights = np.zeros((size, n_in))
        weights[np.arange(size), lo] += 1 - frac
        weights[np.arange(size), hi] += frac
        return weights

    if h > 2 * size or w > 2 * size:  # box-average first so that downscaling does not alias
        fy, fx = max(1, h // (2 * size)), max(1, w // (2 * size))
        h2, w2 = h // fy * fy, w // fx * fx
        frames = frames[:, :h2, :w2].reshape(t, h2 // fy, fy, w2 // fx, fx, 3).mean((2, 4))
        h, w = frames.shape[1:3]
    return np.einsum("yh,thwc,xw->tyxc", axis_weights(h), frames, axis_weights(w)).astype(np.float32)


def _read_png_folder(folder: Path) -> np.ndarray:
    import matplotlib.image as mpimg

    files = sorted(folder.glob("*.png"))
    if not files:
        raise VideoDataError(f"frame folder '{folder}' has no .png frames")
    frames = []
    for file in files:
        try:
            image = mpimg.imread(file)
        except Exception as exc:  # matplotlib raises several types for a corrupt PNG
            raise VideoDataError(f"frame '{file}' is not a readable PNG ({type(exc).__name__})") from None
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, -1)
        image = image[..., :3]
        frames.append(image * 255 if image.dtype != np.uint8 else image)
    shapes = {f.shape for f in frames}
    if len(shapes) != 1:
        raise VideoDataError(f"frames in '{folder}' differ in size: {sorted(shapes)}")
    return np.stack(frames).astype(np.float32)


def _read_array(path: Path) -> np.ndarray:
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                if not archive.files:
                    raise VideoDataError(f"clip '{path}' is an empty .npz archive")
                array = archive[archive.files[0]]
        else:
            array = np.load(path, allow_pickle=False)
    except VideoDataError:
        raise
    except Exception as exc:
        raise VideoDataError(f"clip '{path}' is not a readable numpy array ({type(exc).__name__})") from None
    if array.ndim != 4 or array.shape[-1] != 3:
        raise VideoDataError(f"clip '{path}' has shape {array.shape}; expected (T, H, W, 3) uint8")
    return array.astype(np.float32)


def read_user_clip(path: Path, frames: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One user clip → (frames (T, size, size, 3) in [−1, 1], valid (T,)); longer clips are cut."""
    raw = _read_png_folder(path) if path.is_dir() else _read_array(path)
    if raw.shape[0] < 2:
        raise VideoDataError(f"clip '{path}' has {raw.shape[0]} frame(s); a clip needs at least 2")
    raw = raw[:frames]
    video = _resize(raw, size) / 127.5 - 1.0
    n = video.shape[0]
    padded = np.concatenate([video, np.repeat(video[-1:], frames - n, 0)]) if n < frames else video
    return np.clip(padded, -1, 1).astype(np.float32), np.arange(frames) < n


def load_clip_folder(root: str | Path, frames: int = 8, size: int = 16) -> dict[str, list[tuple[str, Clip]]]:
    """A user folder → {split: [(clip_id, Clip)]} from captions.csv (clip_id, prompt_id, split).

    A clip_id names `<clip_id>.npy`, `<clip_id>.npz` or a folder `<clip_id>/` of PNG frames. Flow is
    unknown (None): estimate it. prompt_id is an integer in [0, N_PROMPTS) or empty for the null prompt.
    """
    root = Path(root)
    if not root.is_dir():
        raise VideoDataError(f"data '{root}' is not a folder (expected clips plus captions.csv)")
    captions = root / "captions.csv"
    if not captions.is_file():
        raise VideoDataError(f"'{captions}' is missing (columns clip_id, prompt_id, split)")
    try:
        with captions.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise VideoDataError(f"'{captions}' is not a readable CSV ({exc})") from None
    if not rows or not {"clip_id", "prompt_id", "split"} <= set(rows[0]):
        raise VideoDataError(f"'{captions}' needs the header clip_id,prompt_id,split and at least one row")
    out: dict[str, list[tuple[str, Clip]]] = {split: [] for split in SPLITS}
    for line, row in enumerate(rows, start=2):
        clip_id, split, prompt = row["clip_id"].strip(), row["split"].strip(), (row["prompt_id"] or "").strip()
        if split not in SPLITS:
            raise VideoDataError(f"'{captions}' line {line}: split '{split}' is not one of {', '.join(SPLITS)}")
        try:
            pid = NULL_PROMPT if prompt == "" else int(prompt)
        except ValueError:
            raise VideoDataError(f"'{captions}' line {line}: prompt_id '{prompt}' is not an integer") from None
        if not 0 <= pid <= NULL_PROMPT:
            raise VideoDataError(f"'{captions}' line {line}: prompt_id {pid} is outside 0..{NULL_PROMPT}")
        candidates = [root / f"{clip_id}.npy", root / f"{clip_id}.npz", root / clip_id]
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            raise VideoDataError(f"'{captions}' line {line}: no clip '{clip_id}' (.npy, .npz or PNG folder) in {root}")
        video, valid = read_user_clip(path, frames, size)
        factors = {"motion": "unknown", "shape": "unknown", "hue": -1, "background": "unknown",
                   "valid_len": int(valid.sum()), "decoy_type": "none", "source": str(path)}
        out[split].append((clip_id, Clip(video, valid, None, pid, factors)))
    for split in ("pretrain", "pool", "query"):
        if not out[split]:
            raise VideoDataError(f"'{captions}' has no clip with split '{split}' (each of pretrain, pool, query is needed)")
    return out
