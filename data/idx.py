"""The MNIST family's IDX files, and Fashion-MNIST read from any of its usual layouts.

- `read_idx(path)`: one IDX file, gzipped or not (told by its first bytes, not its name) → a numpy array.
  Header: two zero bytes, a dtype code (0x08 ubyte, 0x09 byte, 0x0B short, 0x0C int, 0x0D float,
  0x0E double), the number of dimensions, then one big-endian uint32 per dimension; the payload must
  hold exactly the bytes the dimensions announce, no fewer and no more.
- `load_fashion_mnist(path)`: {"train": {"images", "labels"}, "test": {...}, "classes", "folder"}; images
  uint8 [N, 28, 28], labels int64 [N] in 0–9, with the image and label counts of a split agreeing.
- `check_fashion_mnist(path)`: what `load_fashion_mnist` would refuse, found from the headers, the file
  sizes and the (small) label files, without decoding the images: for a method's `check_inputs`.
- `fashion_mnist_splits(path, val, seed)`: the same as float32 `Split`s [N, 1, 28, 28] in [0, 1], with a
  seeded stratified validation split taken from train (torch and scikit-learn imported only here).

`path` is a folder in one of three layouts: Zalando's release or Debian's package (the four
`*-ubyte.gz` files in one folder), or torchvision's (`<root>/FashionMNIST/raw/`, files gzipped and/or
not; the root, `<root>/FashionMNIST` or the raw folder itself). `None` is Debian's
`/usr/share/datasets/fashion-mnist` (package `dataset-fashion-mnist`). Every problem raises
`ImageDataError` (a ValueError) with one line naming the file and the fix.

Decoded files are cached by (path, mtime, size): a second load costs a copy, not a decompression.
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from icml.data.images import ImageDataError, Split

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot")
SIZE = 28
# (split, part) -> the file's name in Zalando's release (Debian and torchvision keep the same names)
FILES = {("train", "images"): "train-images-idx3-ubyte", ("train", "labels"): "train-labels-idx1-ubyte",
         ("test", "images"): "t10k-images-idx3-ubyte", ("test", "labels"): "t10k-labels-idx1-ubyte"}
DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
          0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
GZIP_MAGIC = b"\x1f\x8b"

INSTALL_HINT = (f"Fashion-MNIST is not installed at {DEBIAN_DIR}: install it with `apt-get install "
                "dataset-fashion-mnist` (as root; `make install` does), or pass --data DIR pointing at a copy "
                "(the four *-ubyte[.gz] files of Zalando's release, or torchvision's root with FashionMNIST/raw/)")
REPLACE = ("replace it with an intact copy (`apt-get install --reinstall dataset-fashion-mnist`, "
           "or the file of Zalando's release)")


# one IDX file ---------------------------------------------------------------------------------
def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(2) == GZIP_MAGIC


def _parse_header(head: bytes, path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, dims, header length) of an IDX file whose first bytes are `head`."""
    if len(head) < 4:
        raise ImageDataError(f"'{path}' is truncated: {len(head)} bytes, shorter than an IDX header; {REPLACE}")
    code, ndim = head[2], head[3]
    if head[:2] != b"\0\0" or code not in DTYPES or ndim == 0:
        raise ImageDataError(f"'{path}' is not an IDX file (magic {head[:4].hex(' ')}, expected 00 00 08 0N); "
                             f"{REPLACE}")
    length = 4 + 4 * ndim
    if len(head) < length:
        raise ImageDataError(f"'{path}' is truncated inside its header ({len(head)} of {length} bytes); {REPLACE}")
    return DTYPES[code], struct.unpack(f">{ndim}I", head[4:length]), length


def _check_payload(path: Path, dtype: np.dtype, dims: tuple[int, ...], payload: int) -> None:
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if payload < expected:
        raise ImageDataError(f"'{path}' is truncated: {payload} of the {expected} data bytes its header "
                             f"announces ({' × '.join(map(str, dims))}); {REPLACE}")
    if payload > expected:
        raise ImageDataError(f"'{path}' has {payload - expected} bytes after the {expected} its header announces "
                             f"({' × '.join(map(str, dims))}); {REPLACE}")


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ImageDataError(f"'{path}' cannot be read ({exc.strerror or type(exc).__name__}); "
                             "check its permissions or copy it again") from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as exc:  # truncated stream, bad CRC or length, bad deflate data
        raise ImageDataError(f"'{path}' is a damaged gzip file ({str(exc).rstrip('.')}); {REPLACE}") from None


@lru_cache(maxsize=8)
def _read_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    """The decoded array of a file as of (mtime, size); read-only, shared by the callers of read_idx."""
    buffer = _read_bytes(Path(path))
    dtype, dims, start = _parse_header(buffer[:4 + 4 * 255], Path(path))
    _check_payload(Path(path), dtype, dims, len(buffer) - start)
    return np.frombuffer(buffer, dtype=dtype, offset=start).reshape(dims)


def read_idx(path: str | Path) -> np.ndarray:
    """One IDX file (gzipped or not) → a native-endian numpy array of the header's shape (a fresh copy)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        raise ImageDataError(f"'{path}' does not exist; copy the IDX file there or pass the folder that holds "
                             "it") from None
    array = _read_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    return array.astype(array.dtype.newbyteorder("="), copy=True)


def read_idx_header(path: str | Path) -> tuple[np.dtype, tuple[int, ...]]:
    """(dtype, dims) of an IDX file, with its payload size checked against them, without decoding it:
    a plain file's size is compared; a gzip's uncompressed size is taken from its trailer (ISIZE) and, if
    that disagrees (a multi-member or damaged file), by streaming through it."""
    path = Path(path)
    try:
        gzipped = _is_gzip(path)
        if not gzipped:
            with open(path, "rb") as handle:
                head = handle.read(4 + 4 * 255)
            dtype, dims, start = _parse_header(head, path)
            _check_payload(path, dtype, dims, path.stat().st_size - start)
            return dtype, dims
        with gzip.open(path, "rb") as handle:
            head = handle.read(4 + 4 * 255)
        dtype, dims, start = _parse_header(head, path)
        expected = start + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        with open(path, "rb") as handle:
            handle.seek(-4, os.SEEK_END)
            isize = struct.unpack("<I", handle.read(4))[0]
        if isize != expected % 2 ** 32:
            total = 0
            with gzip.open(path, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    total += len(chunk)
            _check_payload(path, dtype, dims, total - start)
        return dtype, dims
    except FileNotFoundError:
        raise ImageDataError(f"'{path}' does not exist; copy the IDX file there or pass the folder that holds "
                             "it") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ImageDataError(f"'{path}' is a damaged gzip file ({str(exc).rstrip('.')}); {REPLACE}") from None
    except OSError as exc:
        raise ImageDataError(f"'{path}' cannot be read ({exc.strerror or type(exc).__name__}); "
                             "check its permissions or copy it again") from None


# Fashion-MNIST --------------------------------------------------------------------------------
def _variants(name: str) -> tuple[str, ...]:
    """The names a file goes by, uncompressed first (faster): `x-idx3-ubyte`, some mirrors' `x.idx3-ubyte`,
    each gzipped or not."""
    dotted = name.replace("-idx", ".idx")
    return name, dotted, name + ".gz", dotted + ".gz"


def _find(folder: Path, name: str) -> Path | None:
    return next((folder / v for v in _variants(name) if (folder / v).is_file()), None)


def find_fashion_mnist(path: str | Path | None = None) -> dict[tuple[str, str], Path]:
    """The four files of the folder `path` (see the module doc for the layouts); one-line errors."""
    if path is None:
        if not DEBIAN_DIR.is_dir():
            raise ImageDataError(INSTALL_HINT)
        folder, given = DEBIAN_DIR, None
    else:
        given = Path(path).expanduser()
        if not given.exists():
            raise ImageDataError(f"--data '{given}' does not exist; pass the folder that holds the four Fashion-MNIST "
                                 "*-ubyte[.gz] files, or torchvision's root with FashionMNIST/raw/")
        if not given.is_dir():
            raise ImageDataError(f"--data '{given}' is a file, not a folder; pass the folder that holds it and the "
                                 "other Fashion-MNIST *-ubyte[.gz] files")
        candidates = (given, given / "FashionMNIST" / "raw", given / "raw")
        folder = next((c for c in candidates if c.is_dir() and any(_find(c, n) for n in FILES.values())), None)
        if folder is None:
            raise ImageDataError(f"--data '{given}' holds no Fashion-MNIST files (train-images-idx3-ubyte[.gz] and "
                                 "the other three); pass the folder of Zalando's or Debian's files, or "
                                 "torchvision's root with FashionMNIST/raw/")
    files = {}
    for key, name in FILES.items():
        found = _find(folder, name)
        if found is None:
            fix = ("reinstall it: `apt-get install --reinstall dataset-fashion-mnist`" if given is None else
                   "copy it there (gzipped or not) from Zalando's release or /usr/share/datasets/fashion-mnist")
            raise ImageDataError(f"'{folder / name}.gz' is missing (Fashion-MNIST needs train-images-idx3-ubyte, "
                                 f"train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte); {fix}")
        files[key] = found
    return files


def _check_split(files: dict, split: str, image_dims: tuple[int, ...], label_dims: tuple[int, ...],
                 image_dtype: np.dtype, label_dtype: np.dtype) -> None:
    images, labels = files[(split, "images")], files[(split, "labels")]
    if image_dtype != np.uint8 or len(image_dims) != 3 or tuple(image_dims[1:]) != (SIZE, SIZE):
        raise ImageDataError(f"'{images}' holds {image_dtype.name} {' × '.join(map(str, image_dims))}, not "
                             f"N × {SIZE} × {SIZE} unsigned bytes: not Fashion-MNIST images; {REPLACE}")
    if label_dtype != np.uint8 or len(label_dims) != 1:
        raise ImageDataError(f"'{labels}' holds {label_dtype.name} {' × '.join(map(str, label_dims))}, not N "
                             f"unsigned bytes: not Fashion-MNIST labels; {REPLACE}")
    if image_dims[0] != label_dims[0]:
        raise ImageDataError(f"'{images}' holds {image_dims[0]} images but '{labels}' {label_dims[0]} labels; "
                             f"the two files are of different releases or one is damaged: {REPLACE}")
    if image_dims[0] == 0:
        raise ImageDataError(f"'{images}' holds no images; {REPLACE}")


def _check_labels(path: Path, labels: np.ndarray) -> None:
    bad = np.flatnonzero(labels >= len(CLASSES))
    if len(bad):
        raise ImageDataError(f"'{path}' has label {int(labels[bad[0]])} at index {int(bad[0])} "
                             f"(Fashion-MNIST's are 0–{len(CLASSES) - 1}); {REPLACE}")


def check_fashion_mnist(path: str | Path | None = None) -> Path:
    """What `load_fashion_mnist(path)` would refuse, found before a run exists: the layout, every header, the
    payload sizes, the image/label counts and the labels' range (the label files are small; the image files
    are not decoded). Returns the folder the files are in."""
    files = find_fashion_mnist(path)
    for split in ("train", "test"):
        image_dtype, image_dims = read_idx_header(files[(split, "images")])
        label_dtype, label_dims = read_idx_header(files[(split, "labels")])
        _check_split(files, split, image_dims, label_dims, image_dtype, label_dtype)
        _check_labels(files[(split, "labels")], read_idx(files[(split, "labels")]))
    return files[("train", "images")].parent


def load_fashion_mnist(path: str | Path | None = None) -> dict:
    """Fashion-MNIST from `path` (None: Debian's package) →
    {"train": {"images": uint8 [N, 28, 28], "labels": int64 [N]}, "test": {…}, "classes": names, "folder": Path}.
    The arrays are fresh copies (the decoded files stay cached)."""
    files = find_fashion_mnist(path)
    out: dict = {"classes": CLASSES, "folder": files[("train", "images")].parent}
    for split in ("train", "test"):
        images, labels = read_idx(files[(split, "images")]), read_idx(files[(split, "labels")])
        _check_split(files, split, images.shape, labels.shape, images.dtype, labels.dtype)
        _check_labels(files[(split, "labels")], labels)
        out[split] = {"images": images, "labels": labels.astype(np.int64)}
    return out


def fashion_mnist_splits(path: str | Path | None = None, val: int = 5000, seed: int = 0) -> dict[str, Split]:
    """Fashion-MNIST as float32 Splits [N, 1, 28, 28] in [0, 1]: {train, val, test}, where val is a seeded
    stratified draw of `val` images from the 60,000 of train (val=0: no val split) and test is t10k."""
    import torch
    from sklearn.model_selection import train_test_split

    data = load_fashion_mnist(path)

    def split(images: np.ndarray, labels: np.ndarray) -> Split:
        return Split(torch.from_numpy(images).unsqueeze(1).float().div_(255), torch.from_numpy(labels))

    train_x, train_y = data["train"]["images"], data["train"]["labels"]
    out = {"test": split(data["test"]["images"], data["test"]["labels"])}
    if val:
        index = np.arange(len(train_y))
        rest, held = train_test_split(index, test_size=val, stratify=train_y, random_state=seed)
        out["train"], out["val"] = split(train_x[rest], train_y[rest]), split(train_x[held], train_y[held])
    else:
        out["train"] = split(train_x, train_y)
    return {name: out[name] for name in ("train", "val", "test") if name in out}
