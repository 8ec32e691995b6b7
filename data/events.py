"""Event-camera data: file loaders and an ESIM-style saccade simulator.

An event stream is a structured numpy array with fields x, y (pixels), t (µs, int64) and p (0/1),
sorted by t. Every loader is pure numpy/h5py and raises `EventFileError` with one line naming the
file and the problem for truncated or foreign files.

Loaders (one recording per file unless said otherwise):
- `read_bin`     N-MNIST / N-Caltech101: 5-byte records; y == 240 marks a timestamp overflow.
- `read_aedat2`  jAER AEDAT 2.0 (DVS128 addresses; `profile="cifar10dvs"` for CIFAR10-DVS).
- `read_aedat31` AEDAT 3.1 (DVS128 Gesture) polarity packets; `read_gesture_labels` its *_labels.csv.
- `read_npy`     a structured (x, y, t, p) array or an N×4 array with named (or detected) columns.
- `read_npz`     an archive of t, x, y, p arrays.
- `read_h5`      events/{xs,ys,ts,ps}; `read_h5_windows` the preprocessed data/label/mark layout.
- `read_aedat4`  only if the optional `aedat` package is installed.

`load_labelled(path, …)` turns a folder (class subfolders of event files, optionally inside
Train/Test), a DVS-Gesture folder (*.aedat + *_labels.csv) or a data/label/mark .h5 into samples.

Simulator: `simulate_dataset("saccade-digits" | "saccade-shapes" | "direction", …)`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

EVENT_DTYPE = np.dtype([("x", "<i4"), ("y", "<i4"), ("t", "<i8"), ("p", "<i1")])
FORMATS = ("auto", "bin", "aedat2", "aedat31", "aedat4", "npy", "npz", "h5")
EXTENSIONS = {".bin": "bin", ".aedat": "aedat", ".aedat4": "aedat4", ".npy": "npy", ".npz": "npz", ".h5": "h5",
              ".hdf5": "h5"}
OFFICIAL_COLUMNS = "t,x,y,p"  # the official preprocessed data/label/mark windows


class EventFileError(ValueError):
    """A file that cannot be decoded as the event format it claims to be (one line)."""


PLAUSIBLE_FRACTION = 0.01  # share of events a plausibility check lets through (resets, glitches)


def check_time_order(t: np.ndarray, path: Path) -> None:
    """A recording's timestamps rise (bar a clock reset or a rare glitch): refuse a file whose
    timestamps decrease at more than 1 % of its events, e.g. a random or mis-parsed body."""
    falling = float((np.diff(np.asarray(t, np.int64)) < 0).mean()) if len(t) > 1 else 0.0
    if falling > PLAUSIBLE_FRACTION:
        raise EventFileError(f"{path}: timestamps decrease at {falling:.0%} of the events; a recording's clock "
                             "rises, so this is not event data in the expected layout")


def check_events(events: np.ndarray, path: Path, sensor: tuple[int, int] | None) -> np.ndarray:
    """Coordinates inside the sensor (when its size is known) and polarity in {0, 1}."""
    if sensor is not None and len(events) and (events["x"].max() >= sensor[0] or events["y"].max() >= sensor[1]):
        raise EventFileError(f"{path}: events reach x = {int(events['x'].max())}, y = {int(events['y'].max())}, "
                             f"outside the {sensor[0]}×{sensor[1]} sensor (set --set sensor_size=W,H)")
    return events


def detect_columns(rows: np.ndarray, fallback: str = OFFICIAL_COLUMNS) -> str:
    """The column order of an N×4 event array, or of (M, N, 4) windows: t is the one column that
    never decreases (within every window) and is not constant; the other three are x, y, p in file
    order. `fallback` where no single column qualifies."""
    rows = np.asarray(rows, np.float64)
    rows = rows.reshape(1, *rows.shape) if rows.ndim == 2 else rows
    rising = [i for i in range(4) if (np.diff(rows[..., i], axis=1) >= 0).all() and np.ptp(rows[..., i]) > 0]
    if len(rising) != 1:
        return fallback
    others = iter(("x", "y", "p"))
    return ",".join("t" if i == rising[0] else next(others) for i in range(4))


def make_events(x, y, t, p) -> np.ndarray:
    """A time-sorted structured event array (stable sort: equal timestamps keep their order)."""
    out = np.empty(len(t), EVENT_DTYPE)
    out["x"], out["y"], out["t"], out["p"] = x, y, t, p
    return out[np.argsort(out["t"], kind="stable")]


def _read_bytes(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise EventFileError(f"{path}: cannot be read ({exc.strerror})") from None


# N-MNIST / N-Caltech101 .bin ----------------------------------------------------------------------
BIN_OVERFLOW_Y = 240
BIN_OVERFLOW_US = 1 << 13  # tonic's convention: each overflow record adds 2^13 µs to later events


def read_bin(path: Path, sensor: tuple[int, int] | None = None) -> np.ndarray:
    """5-byte records x, y, p|t[22:16], t[15:8], t[7:0]; y == 240 is an overflow marker."""
    raw = np.frombuffer(_read_bytes(path), np.uint8)
    whole = len(raw) // 5 * 5
    if whole == 0:
        raise EventFileError(f"{path}: no complete 5-byte event record (file has {len(raw)} bytes)")
    if whole != len(raw):
        warnings.warn(f"{path}: {len(raw) - whole} trailing bytes of a partial record ignored", stacklevel=2)
    rec = raw[:whole].reshape(-1, 5).astype(np.int64)
    x, y = rec[:, 0], rec[:, 1]
    p = rec[:, 2] >> 7
    t = ((rec[:, 2] & 0x7F) << 16) | (rec[:, 3] << 8) | rec[:, 4]
    overflow = y == BIN_OVERFLOW_Y
    t = t + BIN_OVERFLOW_US * np.cumsum(overflow)  # an overflow shifts itself (dropped) and everything after
    keep = ~overflow
    x, y, t, p = x[keep], y[keep], t[keep], p[keep]
    if len(t) == 0:
        raise EventFileError(f"{path}: only overflow markers, no events")
    if len(t) > 1 and np.mean(np.diff(t) < 0) > 0.01:
        raise EventFileError(f"{path}: timestamps are not increasing — not an N-MNIST/N-Caltech101 .bin file")
    if sensor is not None and (x.max() >= sensor[0] or y.max() >= sensor[1]):
        raise EventFileError(f"{path}: pixel ({x.max()}, {y.max()}) outside the {sensor[0]}×{sensor[1]} sensor "
                             "— not an N-MNIST .bin file, or set sensor_size")
    return make_events(x, y, t, p)


# jAER AEDAT 2.0 -----------------------------------------------------------------------------------
def _skip_header(data: bytes, path: Path, magic: bytes) -> tuple[int, list[bytes]]:
    if not data.startswith(magic):
        raise EventFileError(f"{path}: missing the '{magic.decode()}' header line — not this AEDAT version")
    pos, lines = 0, []
    while pos < len(data) and data[pos:pos + 1] == b"#":
        end = data.find(b"\n", pos)
        if end < 0:
            raise EventFileError(f"{path}: header never ends (truncated file)")
        lines.append(data[pos:end].rstrip(b"\r"))
        pos = end + 1
        if lines[-1].startswith(b"#!END-HEADER"):
            break
    return pos, lines


def read_aedat2(path: Path, profile: str = "dvs128") -> np.ndarray:
    """'#' header lines, then big-endian uint32 (address, timestamp µs) pairs.

    DVS128: p = a & 1, x = (a >> 1) & 0x7F, y = (a >> 8) & 0x7F. `cifar10dvs`: the recordings'
    x axis runs right-to-left and y bottom-to-top relative to the DVS128 layout; the common readers
    (e.g. SpikingJelly's) mirror x (x' = 127 − x) and swap it with y; polarity is 1 − (a & 1).
    """
    data = _read_bytes(path)
    pos, _ = _skip_header(data, path, b"#!AER-DAT2")
    body = len(data) - pos
    whole = body // 8 * 8
    if whole == 0:
        raise EventFileError(f"{path}: AEDAT 2.0 header but no complete 8-byte event")
    if whole != body:
        warnings.warn(f"{path}: {body - whole} trailing bytes of a partial event ignored", stacklevel=2)
    pairs = np.frombuffer(data[pos:pos + whole], ">u4").reshape(-1, 2).astype(np.int64)
    a, t = pairs[:, 0], pairs[:, 1]
    # The masks below accept any 32 bits, so a body that is not DVS128 events would decode to
    # "valid" coordinates: a recording leaves the address bits above 15 clear and its clock rising.
    stray = float(((a >> 16) != 0).mean())
    if stray > PLAUSIBLE_FRACTION:
        raise EventFileError(f"{path}: {stray:.0%} of the AEDAT 2.0 addresses set bits above 15, which DVS128 "
                             "events never do: not a DVS128/CIFAR10-DVS recording (wrong format or profile?)")
    check_time_order(t, path)
    p, x, y = a & 1, (a >> 1) & 0x7F, (a >> 8) & 0x7F
    if profile == "cifar10dvs":
        x, y, p = y, 127 - x, 1 - p
    elif profile != "dvs128":
        raise EventFileError(f"{path}: unknown AEDAT 2.0 profile '{profile}' (dvs128 | cifar10dvs)")
    return make_events(x, y, t, p)


# AEDAT 3.1 (DVS128 Gesture) -----------------------------------------------------------------------
POLARITY_EVENT = 1


def read_aedat31(path: Path) -> np.ndarray:
    """28-byte packet headers (type @0 int16, size @4, ts-overflow @12, capacity @16); polarity
    events are 8 bytes little-endian: data uint32, timestamp int32."""
    data = _read_bytes(path)
    pos, _ = _skip_header(data, path, b"#!AER-DAT3")
    chunks = []
    while pos < len(data):
        if len(data) - pos < 28:
            raise EventFileError(f"{path}: truncated packet header at byte {pos}")
        head = np.frombuffer(data[pos:pos + 28], "<i4")
        kind = int(np.frombuffer(data[pos:pos + 2], "<i2")[0])
        size, overflow, capacity = int(head[1]), int(head[3]), int(head[4])
        if size <= 0 or capacity < 0:
            raise EventFileError(f"{path}: corrupt packet header at byte {pos} (event size {size})")
        start, end = pos + 28, pos + 28 + size * capacity
        if end > len(data):
            raise EventFileError(f"{path}: packet at byte {pos} needs {end - pos} bytes, "
                                 f"{len(data) - pos} left (truncated file)")
        if kind == POLARITY_EVENT and capacity:
            words = np.frombuffer(data[start:end], "<u4").reshape(capacity, size // 4)
            d, ts = words[:, 0].astype(np.int64), words[:, 1].astype(np.int64)
            chunks.append(((d >> 17) & 0x1FFF, (d >> 2) & 0x1FFF, (overflow << 31) | ts, (d >> 1) & 1))
        pos = end
    if not chunks:
        raise EventFileError(f"{path}: no polarity events in any packet")
    x, y, t, p = (np.concatenate(c) for c in zip(*chunks))
    return make_events(x, y, t, p)


def read_gesture_labels(path: Path) -> list[tuple[int, int, int]]:
    """DVS128 Gesture *_labels.csv: a header line, then class, startTime_usec, endTime_usec."""
    try:
        lines = Path(path).read_text().strip().splitlines()
        rows = [tuple(int(v) for v in line.split(",")) for line in lines[1:] if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError):
        raise EventFileError(f"{path}: not a labels CSV (class,startTime_usec,endTime_usec)") from None
    if not rows or any(len(r) != 3 or r[2] <= r[1] for r in rows):
        raise EventFileError(f"{path}: labels CSV needs rows class,start,end with end > start")
    return rows


# numpy / HDF5 -------------------------------------------------------------------------------------
def read_npz(path: Path) -> np.ndarray:
    """An archive of equal-length arrays t, x, y, p (np.savez)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            content = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as exc:
        raise EventFileError(f"{path}: not a readable .npz archive ({exc})") from None
    missing = {"t", "x", "y", "p"} - set(content)
    if missing:
        raise EventFileError(f"{path}: the archive lacks array(s) {sorted(missing)} (needs t, x, y, p)")
    lengths = {key: content[key].size for key in "txyp"}
    if len(set(lengths.values())) != 1:
        raise EventFileError(f"{path}: arrays t, x, y, p differ in length {lengths}")
    p = content["p"].ravel()
    if not np.isin(p, (0, 1, -1)).all():
        raise EventFileError(f"{path}: polarity p must be 0/1 (or ±1), found {np.unique(p)[:5].tolist()}")
    check_time_order(content["t"].ravel(), path)
    return make_events(content["x"].ravel(), content["y"].ravel(), content["t"].ravel(), p > 0)


def read_npy(path: Path, columns: str = "auto") -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EventFileError(f"{path}: not a .npy array ({exc})") from None
    if array.dtype.names:
        missing = {"x", "y", "t", "p"} - set(array.dtype.names)
        if missing:
            raise EventFileError(f"{path}: structured array lacks field(s) {sorted(missing)}")
        return make_events(array["x"], array["y"], array["t"], array["p"])
    if columns == "auto" and array.ndim == 2 and array.shape[1] == 4:
        columns = detect_columns(array, fallback="x,y,t,p")
    names = [c.strip() for c in columns.split(",")]
    if array.ndim != 2 or array.shape[1] != len(names) or sorted(names) != ["p", "t", "x", "y"]:
        raise EventFileError(f"{path}: expected a structured array or N×4 with columns '{columns}', "
                             f"got shape {array.shape}")
    col = {n: array[:, i] for i, n in enumerate(names)}
    return make_events(col["x"], col["y"], col["t"], col["p"] > 0)


def _open_h5(path: Path):
    import h5py

    try:
        return h5py.File(path, "r")
    except OSError:
        raise EventFileError(f"{path}: not an HDF5 file (or truncated)") from None


def read_h5(path: Path) -> np.ndarray:
    with _open_h5(path) as f:
        if "events" not in f or not all(k in f["events"] for k in ("xs", "ys", "ts", "ps")):
            raise EventFileError(f"{path}: no events/{{xs,ys,ts,ps}} datasets")
        g = f["events"]
        xs, ys, ts, ps = (np.asarray(g[k]) for k in ("xs", "ys", "ts", "ps"))
    if not len(xs) == len(ys) == len(ts) == len(ps):
        raise EventFileError(f"{path}: events/xs, ys, ts, ps differ in length")
    ts = ts.astype(np.float64)
    if ts.size and ts.max() < 1e3:  # seconds, as most h5 exports store them
        ts = ts * 1e6
    return make_events(xs, ys, np.round(ts).astype(np.int64), ps > 0)


def read_h5_windows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The official preprocessed layout: data (M, N, 4) windows, label (M,), mark (M,) sample ids."""
    with _open_h5(path) as f:
        if not all(k in f for k in ("data", "label")):
            raise EventFileError(f"{path}: needs 'data' and 'label' datasets (and optionally 'mark')")
        data, label = np.asarray(f["data"], np.float32), np.asarray(f["label"]).astype(np.int64).ravel()
        mark = np.asarray(f["mark"]).astype(np.int64).ravel() if "mark" in f else np.arange(len(label))
    if data.ndim != 3 or data.shape[2] != 4 or len(data) != len(label) or len(mark) != len(label):
        raise EventFileError(f"{path}: data must be (M, N, 4) with M labels and marks, got {data.shape}")
    return data, label, mark


def read_aedat4(path: Path) -> np.ndarray:
    try:
        import aedat  # optional
    except ImportError:
        raise EventFileError(f"{path}: AEDAT 4 needs the optional 'aedat' package (pip install aedat)") from None
    chunks = [packet["events"] for packet in aedat.Decoder(str(path)) if "events" in packet]
    if not chunks:
        raise EventFileError(f"{path}: no event packets")
    ev = np.concatenate(chunks)
    return make_events(ev["x"], ev["y"], ev["t"], ev["on"])


def detect_format(path: Path) -> str:
    path = Path(path)
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        raise EventFileError(f"{path}: unknown event file extension (use .bin .aedat .aedat4 .npy .h5 "
                             "or set format)")
    if kind == "aedat":
        with open(path, "rb") as f:
            head = f.read(12)
        kind = "aedat31" if head.startswith(b"#!AER-DAT3") else "aedat2"
    return kind


def read_events(path: Path, fmt: str = "auto", *, sensor=None, profile="dvs128", columns="auto"):
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "bin":
        return read_bin(path, sensor)
    if fmt == "aedat2":
        return read_aedat2(path, profile)
    if fmt == "aedat31":
        return read_aedat31(path)
    if fmt == "aedat4":
        return read_aedat4(path)
    if fmt == "npy":
        return read_npy(path, columns)
    if fmt == "npz":
        return read_npz(path)
    if fmt == "h5":
        return read_h5(path)
    raise EventFileError(f"{path}: unknown format '{fmt}' ({', '.join(FORMATS)})")


# labelled datasets --------------------------------------------------------------------------------
@dataclass
class EventDataset:
    """Samples of one task. `events[i]` is a structured stream; `split[i]` is train|test|"" (seeded
    80/20 later). Pre-windowed data (h5 data/label/mark) sets `clouds` instead of `events`."""

    name: str
    sensor: tuple[int, int]  # (W, H)
    classes: list[str]
    labels: np.ndarray
    events: list[np.ndarray] = field(default_factory=list)
    split: np.ndarray | None = None
    clouds: np.ndarray | None = None  # (M, N, 4) windows already in (t, x, y, p)
    marks: np.ndarray | None = None


KNOWN_SENSORS = {"bin": (34, 34), "aedat2": (128, 128), "aedat31": (128, 128)}


def _event_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)


def load_labelled(path: Path, fmt: str = "auto", *, sensor: tuple[int, int] | None = None,
                  profile: str = "dvs128", columns: str = "auto", max_per_class: int | None = None
                  ) -> EventDataset:
    """A labelled dataset from files.

    - a folder of class subfolders of event files (N-MNIST, N-Caltech101, CIFAR10-DVS layouts); a
      top level `Train`/`Test` (any case) split is kept, otherwise the split is seeded 80/20 later;
    - a folder (or one .aedat file) of AEDAT 3.1 recordings with `<name>_labels.csv` beside each
      (DVS128 Gesture): one sample per labelled segment;
    - a .h5 file with data/label/mark: preprocessed windows.
    """
    path = Path(path)
    if path.is_file() and path.suffix.lower() in (".h5", ".hdf5"):
        with _open_h5(path) as f:
            windowed = "data" in f and "label" in f
        if not windowed:
            raise EventFileError(f"{path}: a single recording has no labels — pass a folder of class "
                                 "subfolders, or an .h5 with data/label/mark")
        data, label, mark = read_h5_windows(path)
        names = [str(c) for c in np.unique(label)]
        labels = np.searchsorted(np.unique(label), label)
        return EventDataset(path.stem, sensor or (1, 1), names, labels, clouds=data, marks=mark)
    gestures = ([path] if path.is_file() else sorted(path.glob("*.aedat"))) if path.exists() else []
    gestures = [g for g in gestures if g.with_name(g.stem + "_labels.csv").exists()]
    if gestures:
        return _load_gestures(gestures, sensor, max_per_class)
    if not path.is_dir():
        raise EventFileError(f"{path}: a single event file has no labels — pass a folder of class subfolders "
                             "(e.g. N-MNIST's Train/0/*.bin), a DVS-Gesture folder or a data/label/mark .h5")
    top = {p.name.lower(): p for p in path.iterdir() if p.is_dir()}
    splits = [("train", top["train"]), ("test", top["test"])] if "train" in top and "test" in top \
        else [("", path)]
    classes = sorted({c.name for _, root in splits for c in root.iterdir() if c.is_dir()})
    if not classes:
        raise EventFileError(f"{path}: no class subfolders (expected e.g. {path}/0/*.bin, {path}/1/*.bin)")
    events, labels, split = [], [], []
    for name, root in splits:
        for ci, cls in enumerate(classes):
            files = _event_files(root / cls) if (root / cls).is_dir() else []
            for f in files[:max_per_class] if max_per_class else files:
                kind = detect_format(f) if fmt == "auto" else fmt
                ev = read_events(f, kind, sensor=sensor, profile=profile, columns=columns)
                events.append(check_events(ev, f, sensor or KNOWN_SENSORS.get(kind)))
                labels.append(ci)
                split.append(name)
                sensor = sensor or KNOWN_SENSORS.get(kind)
    if not events:
        raise EventFileError(f"{path}: class subfolders hold no event files (.bin .aedat .npy .npz .h5)")
    if sensor is None:
        sensor = (int(max(e["x"].max() for e in events)) + 1, int(max(e["y"].max() for e in events)) + 1)
    return EventDataset(path.name, tuple(sensor), classes, np.array(labels),
                        events, np.array(split) if splits[0][0] else None)


def _load_gestures(files: list[Path], sensor, max_per_class) -> EventDataset:
    """One sample per labelled segment [start, end) of each recording; labels are the CSV's class ids."""
    events, labels = [], []
    for f in files:
        stream = read_aedat31(f)
        for cls, start, end in read_gesture_labels(f.with_name(f.stem + "_labels.csv")):
            if max_per_class and labels.count(cls) >= max_per_class:
                continue
            lo, hi = np.searchsorted(stream["t"], [start, end])
            if hi > lo:
                events.append(stream[lo:hi])
                labels.append(cls)
    if not events:
        raise EventFileError(f"{files[0]}: no events inside any labelled segment")
    ids = np.unique(labels)
    return EventDataset("dvs-gesture", tuple(sensor or (128, 128)), [str(c) for c in ids],
                        np.searchsorted(ids, labels), events)


# ESIM-style saccade simulator ---------------------------------------------------------------------
SENSOR = 34
SHAPES = ("circle", "ring", "square", "triangle", "cross", "X", "H-bar", "V-bar", "diamond", "L")
DIRECTIONS = ("right", "left", "up", "down")


@dataclass
class SimulatorConfig:
    """ESIM-style parameters of the spec; every recording is 300 ms rendered at 1 kHz."""

    threshold_mean: float = 0.2
    threshold_sd: float = 0.03
    threshold_min: float = 0.05
    log_eps: float = 0.05
    refractory_us: int = 500
    noise_hz: float = 0.2  # per pixel
    frame_us: int = 1000
    duration_us: int = 300_000
    saccade_px: float = 3.0
    direction_px: float = 6.0


def digit_images(n: int | None, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """sklearn digits (8×8, 0–16) → 0–255, bilinear to 28×28, zero-padded to 34×34."""
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = rng.permutation(len(digits.target))[:n] if n else np.arange(len(digits.target))
    small = digits.images[order] * (255.0 / 16.0)
    big = np.clip(zoom(small, (1, 28 / 8, 28 / 8), order=1), 0, 255)
    out = np.zeros((len(order), SENSOR, SENSOR))
    out[:, 3:31, 3:31] = big
    return out, digits.target[order].astype(np.int64)


def _segments(kind: str) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Stroke segments of the outline shapes in a unit square [-1, 1]²."""
    def poly(points):
        return [(points[i], points[(i + 1) % len(points)]) for i in range(len(points))]
    return {"square": poly([(-1, -1), (1, -1), (1, 1), (-1, 1)]),
            "triangle": poly([(0, -1), (1, 0.8), (-1, 0.8)]),
            "diamond": poly([(0, -1), (1, 0), (0, 1), (-1, 0)]),
            "cross": [((-1, 0), (1, 0)), ((0, -1), (0, 1))],
            "X": [((-1, -1), (1, 1)), ((-1, 1), (1, -1))],
            "H-bar": [((-1, 0), (1, 0))],
            "V-bar": [((0, -1), (0, 1))],
            "L": [((-0.7, -1), (-0.7, 1)), ((-0.7, 1), (0.9, 1))]}[kind]


def shape_image(kind: str, size: int, center: tuple[float, float], scale: float, angle: float,
                stroke: float, supersample: int = 4) -> np.ndarray:
    """A white shape on black, anti-aliased by supersampling; scale = half-size in pixels."""
    step = 1.0 / supersample
    grid = (np.arange(size * supersample) + 0.5) * step - 0.5
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    c, s = np.cos(angle), np.sin(angle)
    u = (c * (xx - center[0]) + s * (yy - center[1])) / scale  # shape frame, unit half-size
    v = (-s * (xx - center[0]) + c * (yy - center[1])) / scale
    half = stroke / 2 / scale
    r = np.hypot(u, v)
    if kind == "circle":
        mask = r <= 1
    elif kind == "ring":
        mask = np.abs(r - 0.8) <= half
    else:
        dist = np.full(u.shape, np.inf)
        for (ax, ay), (bx, by) in _segments(kind):
            dx, dy = bx - ax, by - ay
            h = np.clip(((u - ax) * dx + (v - ay) * dy) / (dx * dx + dy * dy), 0, 1)
            dist = np.minimum(dist, np.hypot(u - ax - h * dx, v - ay - h * dy))
        mask = dist <= half
    return 255.0 * mask.reshape(size, supersample, size, supersample).mean(axis=(1, 3))


def random_shapes(n: int, rng: np.random.Generator, canvas: int, scale: tuple[float, float],
                  margin: float) -> tuple[np.ndarray, np.ndarray]:
    """n random shapes (class = shape index) with random scale, rotation ±20°, stroke 1.5–3 px,
    centred at a random point at least `margin` + scale from the canvas border."""
    labels = rng.integers(0, len(SHAPES), n)
    images = np.zeros((n, canvas, canvas))
    for i, label in enumerate(labels):
        half = rng.uniform(*scale)
        lo, hi = margin + half, canvas - 1 - margin - half
        center = (rng.uniform(lo, hi), rng.uniform(lo, hi)) if hi > lo else ((canvas - 1) / 2,) * 2
        images[i] = shape_image(SHAPES[label], canvas, center, half, rng.uniform(-0.35, 0.35),
                                rng.uniform(1.5, 3.0))
    return images, labels.astype(np.int64)


def _shift_bilinear(images: np.ndarray, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """images (B, H, W) moved by (dx, dy) pixels each, sub-pixel bilinear; outside is black."""
    b, h, w = images.shape
    pad = int(np.ceil(max(np.abs(dx).max(), np.abs(dy).max()))) + 1
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad)))
    iy, ix = np.floor(-dy).astype(int) + pad, np.floor(-dx).astype(int) + pad  # source of output (0, 0)
    fy, fx = (-dy - np.floor(-dy))[:, None, None], (-dx - np.floor(-dx))[:, None, None]
    rows = np.take_along_axis(padded, (iy[:, None] + np.arange(h + 1))[:, :, None], axis=1)
    patch = np.take_along_axis(rows, (ix[:, None] + np.arange(w + 1))[:, None, :], axis=2)
    top = patch[:, :-1, :-1] * (1 - fx) + patch[:, :-1, 1:] * fx
    bottom = patch[:, 1:, :-1] * (1 - fx) + patch[:, 1:, 1:] * fx
    return top * (1 - fy) + bottom * fy


def saccade_path(cfg: SimulatorConfig, times_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Three linear 100 ms saccades around a triangle of side `saccade_px` (as N-MNIST's ATIS moves)."""
    a = cfg.saccade_px
    corners = np.array([(0.0, 0.0), (a, 0.0), (a / 2, a * np.sqrt(3) / 2), (0.0, 0.0)])
    phase = np.clip(times_us / cfg.duration_us * 3, 0, 3 - 1e-9)
    leg, frac = phase.astype(int), phase % 1
    pos = corners[leg] + (corners[leg + 1] - corners[leg]) * frac[:, None]
    return pos[:, 0], pos[:, 1]


def simulate_events(images: np.ndarray, offsets, cfg: SimulatorConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """ESIM-style DVS on a batch of moving images.

    offsets(k) -> (dx (B,), dy (B,)) is the image displacement at frame k. Per pixel: reference log
    intensity L_ref, threshold C ~ N(0.2, 0.03²) ≥ 0.05. Each frame emits n = ⌊|L − L_ref| / C⌋ events
    of sign(ΔL), evenly spread over the frame interval, then L_ref += sign·n·C. An event within the
    refractory period of the pixel's previous event is dropped (L_ref still moves). Poisson
    background noise of random polarity is added last.
    """
    b, h, w = images.shape
    n_frames = cfg.duration_us // cfg.frame_us
    threshold = np.maximum(rng.normal(cfg.threshold_mean, cfg.threshold_sd, (b, h, w)), cfg.threshold_min)
    log_of = lambda img: np.log(img / 255.0 + cfg.log_eps)  # noqa: E731
    dx, dy = offsets(0)
    reference = log_of(_shift_bilinear(images, dx, dy))
    last = np.full((b, h, w), -10 * cfg.refractory_us, np.int64)
    found = []
    for k in range(1, n_frames + 1):
        dx, dy = offsets(k)
        level = log_of(_shift_bilinear(images, dx, dy))
        delta = level - reference
        count = np.floor(np.abs(delta) / threshold).astype(np.int64)
        sign = np.sign(delta).astype(np.int64)
        reference += sign * count * threshold
        bi, yi, xi = np.nonzero(count)
        if len(bi) == 0:
            continue
        n = count[bi, yi, xi]
        start = (k - 1) * cfg.frame_us
        for j in range(int(n.max())):  # j-th event of each active pixel, in time order
            active = n > j
            bj, yj, xj = bi[active], yi[active], xi[active]
            t = start + ((j + 0.5) * cfg.frame_us / n[active]).astype(np.int64)
            ok = t - last[bj, yj, xj] >= cfg.refractory_us
            last[bj[ok], yj[ok], xj[ok]] = t[ok]
            found.append(np.stack([bj[ok], xj[ok], yj[ok], t[ok], sign[bj[ok], yj[ok], xj[ok]] > 0], 1))
    n_noise = rng.poisson(cfg.noise_hz * h * w * cfg.duration_us * 1e-6, b)
    sample = np.repeat(np.arange(b), n_noise)
    total = int(n_noise.sum())
    found.append(np.stack([sample, rng.integers(0, w, total), rng.integers(0, h, total),
                           rng.integers(0, cfg.duration_us, total), rng.integers(0, 2, total)], 1))
    allev = np.concatenate(found).astype(np.int64)
    allev = allev[np.lexsort((allev[:, 3], allev[:, 0]))]
    bounds = np.searchsorted(allev[:, 0], np.arange(b + 1))
    return [make_events(*allev[bounds[i]:bounds[i + 1], 1:].T) for i in range(b)]


def simulate_dataset(kind: str, n: int | None, seed: int, cfg: SimulatorConfig | None = None,
                     batch: int = 256) -> EventDataset:
    """saccade-digits (sklearn digits), saccade-shapes (10 drawn shapes) or direction (a shape
    translating right/left/up/down by `direction_px` over the recording)."""
    cfg = cfg or SimulatorConfig()
    rng = np.random.default_rng(seed)
    if kind == "saccade-digits":
        images, labels = digit_images(n, rng)
        classes = [str(d) for d in range(10)]
    elif kind == "saccade-shapes":
        images, labels = random_shapes(n or 1000, rng, SENSOR, (6.0, 10.0), cfg.saccade_px)
        classes = list(SHAPES)
    elif kind == "direction":
        images, _ = random_shapes(n or 1000, rng, SENSOR, (4.0, 7.0), cfg.direction_px)
        labels = rng.integers(0, len(DIRECTIONS), len(images)).astype(np.int64)
        classes = list(DIRECTIONS)
    else:
        raise ValueError(f"unknown simulated dataset '{kind}' (saccade-digits | saccade-shapes | direction)")
    events = []
    for lo in range(0, len(images), batch):
        chunk, lab = images[lo:lo + batch], labels[lo:lo + batch]
        if kind == "direction":
            unit = np.array([(1, 0), (-1, 0), (0, -1), (0, 1)], float)[lab]  # image y grows downwards
            # start half a path before the centre so the shape stays on the sensor
            def offsets(k, unit=unit):
                frac = k * cfg.frame_us / cfg.duration_us - 0.5
                return unit[:, 0] * cfg.direction_px * frac, unit[:, 1] * cfg.direction_px * frac
        else:
            path_x, path_y = saccade_path(cfg, np.arange(cfg.duration_us // cfg.frame_us + 1) * cfg.frame_us)
            ones = np.ones(len(chunk))

            def offsets(k, ones=ones):
                return ones * path_x[k], ones * path_y[k]
        events += simulate_events(chunk, offsets, cfg, rng)
    return EventDataset(kind, (SENSOR, SENSOR), classes, labels, events)
