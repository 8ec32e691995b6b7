"""Fashion-MNIST and Fashion-MNIST-C (data/idx.py, data/fashion_c.py): the real files of Debian's package
load; the three layouts and gzipped/raw files agree; every bad input is one line naming the file and the
fix, from the full loader and from the pre-run check alike; every corruption type at every severity keeps
shape and range, is seeded, order- and batch-free, and moves the image further as severity grows.

These tests need Debian's `dataset-fashion-mnist` (`make install` installs it): where it is missing they
FAIL with the install hint, never skip."""
from __future__ import annotations

import gzip
import shutil
import struct
import time

import numpy as np
import pytest
import torch

from icml.data import fashion_c as fc
from icml.data import idx
from icml.data import images as img

CODES = {np.dtype("uint8"): 0x08, np.dtype("int8"): 0x09, np.dtype("int16"): 0x0B, np.dtype("int32"): 0x0C,
         np.dtype("float32"): 0x0D, np.dtype("float64"): 0x0E}
TRAIN_N = 200  # the small train split written by the layout fixtures


def write_idx(path, array, gz: bool = False, code: int | None = None) -> None:
    """`array` as an IDX file (big-endian, the header of its dtype unless `code` is given)."""
    array = np.ascontiguousarray(array)
    code = CODES[array.dtype] if code is None else code
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)


def one_line_error(call, *match: str) -> str:
    with pytest.raises(idx.ImageDataError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in match:
        assert part in message, (part, message)
    return message


@pytest.fixture(scope="module")
def small(fashion_mnist):
    """A small train split (the first 200 t10k images, written here) and the real t10k arrays."""
    test = fashion_mnist["test"]
    return {"train_images": test["images"][:TRAIN_N], "train_labels": test["labels"][:TRAIN_N],
            "test_images": test["images"], "test_labels": test["labels"]}


def zalando(folder, small, gz: bool = True, raw: bool = False):
    """Zalando's / Debian's layout in `folder`: the real t10k files, a small train split; gzipped and/or raw."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        source = idx.DEBIAN_DIR / f"t10k-{part}.gz"
        if gz:
            shutil.copyfile(source, folder / f"t10k-{part}.gz")
        if raw:
            (folder / f"t10k-{part}").write_bytes(gzip.decompress(source.read_bytes()))
    for flag, suffix in ((gz, ".gz"), (raw, "")):
        if flag:
            write_idx(folder / f"train-images-idx3-ubyte{suffix}", small["train_images"], gz=bool(suffix))
            write_idx(folder / f"train-labels-idx1-ubyte{suffix}", small["train_labels"].astype(np.uint8),
                      gz=bool(suffix))
    return folder


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[s][p], b[s][p]) for s in ("train", "test") for p in ("images", "labels"))


# the real files ------------------------------------------------------------------------------
def test_debians_files_load_whole_and_balanced(fashion_mnist):
    for split, n in (("train", 60_000), ("test", 10_000)):
        images, labels = fashion_mnist[split]["images"], fashion_mnist[split]["labels"]
        assert images.shape == (n, 28, 28) and images.dtype == np.uint8
        assert labels.shape == (n,) and labels.dtype == np.int64
        assert np.bincount(labels, minlength=10).tolist() == [n // 10] * 10
    assert fashion_mnist["train"]["labels"][:5].tolist() == [9, 0, 0, 3, 0]  # Zalando's order: an ankle boot first
    assert fashion_mnist["test"]["labels"][:5].tolist() == [9, 2, 1, 1, 6]
    assert int(fashion_mnist["train"]["images"][0].sum()) == 76247 and int(fashion_mnist["test"]["images"].max()) == 255
    assert fashion_mnist["folder"] == idx.DEBIAN_DIR and len(fashion_mnist["classes"]) == 10
    assert idx.check_fashion_mnist(None) == idx.DEBIAN_DIR
    start = time.perf_counter()
    again = idx.load_fashion_mnist(str(idx.DEBIAN_DIR))  # cached: a copy, not a decompression
    assert time.perf_counter() - start < 1.0 and same(again, fashion_mnist)
    again["train"]["images"][0] = 0  # the caller's copy, not the cache
    assert int(idx.load_fashion_mnist(None)["train"]["images"][0].sum()) == 76247


def test_float_splits_are_stratified_and_in_range(fashion_mnist):
    splits = idx.fashion_mnist_splits(None, val=5000, seed=0)
    assert [len(splits[s]) for s in ("train", "val", "test")] == [55_000, 5000, 10_000]
    assert splits["val"].images.shape[1:] == (1, 28, 28) and splits["val"].images.dtype == torch.float32
    assert np.bincount(splits["val"].labels.numpy()).tolist() == [500] * 10
    assert float(splits["test"].images.max()) == 1.0 and float(splits["test"].images.min()) == 0.0
    assert torch.equal(splits["test"].images[0, 0], torch.from_numpy(fashion_mnist["test"]["images"][0]).float() / 255)
    assert torch.equal(idx.fashion_mnist_splits(None, val=5000, seed=0)["val"].labels, splits["val"].labels)
    assert set(idx.fashion_mnist_splits(None, val=0)) == {"train", "test"}


# layouts ---------------------------------------------------------------------------------------
def test_the_three_layouts_and_gzipped_or_raw_files_load_the_same(tmp_path, small):
    reference = idx.load_fashion_mnist(zalando(tmp_path / "zalando", small))
    assert reference["train"]["images"].shape == (TRAIN_N, 28, 28)
    assert np.array_equal(reference["test"]["images"], small["test_images"])
    assert np.array_equal(reference["train"]["labels"], small["train_labels"])
    root = tmp_path / "torchvision"
    zalando(root / "FashionMNIST" / "raw", small, gz=True, raw=True)  # torchvision keeps both after download
    for given in (root, root / "FashionMNIST", root / "FashionMNIST" / "raw"):
        loaded = idx.load_fashion_mnist(given)
        assert same(loaded, reference) and loaded["folder"] == root / "FashionMNIST" / "raw"
        assert idx.check_fashion_mnist(str(given)) == root / "FashionMNIST" / "raw"
    raw_only = zalando(tmp_path / "raw" / "FashionMNIST" / "raw", small, gz=False, raw=True)
    assert same(idx.load_fashion_mnist(tmp_path / "raw"), reference)
    assert idx.check_fashion_mnist(raw_only) == raw_only
    dotted = tmp_path / "dotted"  # some mirrors name them train-images.idx3-ubyte
    for path in zalando(tmp_path / "plain", small, gz=False, raw=True).iterdir():
        dotted.mkdir(exist_ok=True)
        shutil.copyfile(path, dotted / path.name.replace("-idx", ".idx"))
    assert same(idx.load_fashion_mnist(dotted), reference)


def test_read_idx_is_the_same_gzipped_or_not_for_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    for dtype in CODES:
        array = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
        write_idx(tmp_path / f"{dtype}.idx", array)
        write_idx(tmp_path / f"{dtype}.idx.gz", array, gz=True)
        for name in (f"{dtype}.idx", f"{dtype}.idx.gz"):
            read = idx.read_idx(tmp_path / name)
            assert read.dtype == dtype and read.dtype.isnative and np.array_equal(read, array)
            assert idx.read_idx_header(tmp_path / name) == (np.dtype(dtype).newbyteorder(">"), (3, 4, 5))
    gz_named_plain = tmp_path / "plain.gz"  # told by content, not by name
    write_idx(gz_named_plain, np.arange(6, dtype=np.uint8))
    assert idx.read_idx(gz_named_plain).tolist() == list(range(6))


# bad inputs ------------------------------------------------------------------------------------
def bad_folder(tmp_path, small, name: str):
    return zalando(tmp_path / name, small, gz=False, raw=True)


@pytest.mark.parametrize("loader", [idx.load_fashion_mnist, idx.check_fashion_mnist], ids=["load", "check"])
def test_bad_inputs_are_one_line_naming_the_file_and_the_fix(tmp_path, small, loader):
    fix = "replace it with an intact copy"

    folder = bad_folder(tmp_path, small, "magic")  # not an IDX file
    (folder / "train-images-idx3-ubyte").write_bytes(b"PK\x03\x04" + bytes(100))
    one_line_error(lambda: loader(folder), "train-images-idx3-ubyte", "not an IDX file", "50 4b 03 04", fix)
    write_idx(folder / "train-images-idx3-ubyte", small["train_images"], code=0x07)  # unknown dtype code
    one_line_error(lambda: loader(folder), "not an IDX file", fix)

    folder = bad_folder(tmp_path, small, "truncated")
    path = folder / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-784])
    one_line_error(lambda: loader(folder), str(path), "truncated", "7839216 of the 7840000", fix)
    path.write_bytes(path.read_bytes()[:10])
    one_line_error(lambda: loader(folder), str(path), "truncated inside its header", fix)

    folder = zalando(tmp_path / "truncated_gz", small)  # a download cut short
    path = folder / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:100_000])
    one_line_error(lambda: loader(folder), str(path), "damaged gzip file", fix)

    folder = bad_folder(tmp_path, small, "trailing")
    path = folder / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes() + b"\0\0\0")
    one_line_error(lambda: loader(folder), str(path), "3 bytes after", fix)

    folder = bad_folder(tmp_path, small, "counts")  # 200 images, 199 labels
    write_idx(folder / "train-labels-idx1-ubyte", small["train_labels"][:-1].astype(np.uint8))
    one_line_error(lambda: loader(folder), "train-images-idx3-ubyte' holds 200 images",
                   "train-labels-idx1-ubyte' 199 labels", fix)

    folder = bad_folder(tmp_path, small, "label11")
    labels = small["train_labels"].astype(np.uint8)
    labels[17] = 11
    write_idx(folder / "train-labels-idx1-ubyte", labels)
    one_line_error(lambda: loader(folder), "train-labels-idx1-ubyte", "label 11 at index 17", "0–9", fix)

    folder = bad_folder(tmp_path, small, "shape")  # MNIST-like but 32×32
    write_idx(folder / "train-images-idx3-ubyte", np.zeros((TRAIN_N, 32, 32), np.uint8))
    one_line_error(lambda: loader(folder), "uint8 200 × 32 × 32", "not N × 28 × 28", fix)

    folder = bad_folder(tmp_path, small, "missing")
    (folder / "t10k-labels-idx1-ubyte").unlink()
    one_line_error(lambda: loader(folder), f"'{folder / 't10k-labels-idx1-ubyte'}.gz' is missing", "copy it there")

    folder = bad_folder(tmp_path, small, "file")
    one_line_error(lambda: loader(folder / "train-images-idx3-ubyte"), "is a file, not a folder",
                   "pass the folder that holds it")
    one_line_error(lambda: loader(tmp_path / "nowhere"), "does not exist", "pass the folder")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: loader(tmp_path / "empty"), "holds no Fashion-MNIST files", "FashionMNIST/raw/")


def test_no_path_and_no_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(idx, "DEBIAN_DIR", tmp_path / "absent")
    for loader in (idx.load_fashion_mnist, idx.check_fashion_mnist):
        one_line_error(lambda: loader(None), "apt-get install dataset-fashion-mnist", "--data DIR")
    (tmp_path / "absent").mkdir()  # the package's folder without its files: reinstall
    one_line_error(lambda: idx.load_fashion_mnist(None), "is missing",
                   "apt-get install --reinstall dataset-fashion-mnist")


def test_the_check_decodes_no_image_file(tmp_path, small, monkeypatch):
    folder = zalando(tmp_path / "z", small)
    decoded = []
    monkeypatch.setattr(idx, "read_idx", lambda path, real=idx.read_idx: decoded.append(path) or real(path))
    assert idx.check_fashion_mnist(folder) == folder
    assert decoded and all("labels" in p.name for p in decoded)


# Fashion-MNIST-C -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean(fashion_mnist):
    return torch.from_numpy(fashion_mnist["test"]["images"][:200]).unsqueeze(1).float() / 255


def test_the_suite_and_its_split():
    assert set(fc.PARAMS) == set(fc.FASHION_C) and all(len(v) == 5 for v in fc.PARAMS.values())
    assert set(fc.SEEN) | set(fc.HELDOUT) == set(fc.FASHION_C) and not set(fc.SEEN) & set(fc.HELDOUT)
    assert set(fc.HELDOUT) == {"impulse_noise", "fog", "jpeg_compression"}
    assert set(fc.RANDOM) < set(fc.FASHION_C)
    assert img.CORRUPTIONS == img.DIGITS_C + img.DIGITS_LC and "brightness" not in img.PARAMS  # digits_c as it was
    x = torch.zeros(2, 1, 28, 28)
    with pytest.raises(ValueError, match="unknown Fashion-MNIST-C corruption"):
        fc.corrupt(x, "frost", 1, 0)
    with pytest.raises(ValueError, match="severity must be 1–5"):
        fc.corrupt(x, "fog", 6, 0)
    with pytest.raises(ValueError, match="3 ids for 2 images"):
        fc.corrupt(x, "fog", 1, 0, ids=[0, 1, 2])
    assert fc.corrupt(x[:0], "fog", 1, 0).shape == (0, 1, 28, 28)


@pytest.mark.parametrize("kind", fc.FASHION_C)
def test_every_type_is_clipped_seeded_and_severity_monotone(clean, kind):
    change = []
    for severity in fc.SEVERITIES:
        out = fc.corrupt(clean, kind, severity, seed=3)
        assert out.shape == clean.shape and out.dtype == torch.float32
        assert float(out.min()) >= 0 and float(out.max()) <= 1
        assert torch.equal(out, fc.corrupt(clean, kind, severity, seed=3))  # bitwise
        other = fc.corrupt(clean, kind, severity, seed=4)
        assert torch.equal(out, other) != (kind in fc.RANDOM), "only the random types depend on the seed"
        change.append(float((out - clean).abs().mean()))
    assert change[0] > 0.01, (kind, change)
    assert all(a < b for a, b in zip(change, change[1:])), (kind, change)


@pytest.mark.parametrize("kind", fc.FASHION_C)
def test_a_corrupted_image_does_not_depend_on_its_batch(clean, kind):
    x = clean[:24]
    full = fc.corrupt(x, kind, 4, seed=1)
    order = [19, 2, 11, 7]
    assert torch.equal(fc.corrupt(x[order], kind, 4, seed=1, ids=order), full[order])
    assert torch.equal(fc.corrupt(x[5:6], kind, 4, seed=1, ids=[5]), full[5:6])
    chunks = [fc.corrupt(x[i:i + 7], kind, 4, seed=1, ids=range(i, min(i + 7, len(x)))) for i in range(0, 24, 7)]
    assert torch.equal(torch.cat(chunks), full)


def test_closed_forms_of_brightness_contrast_and_jpeg(clean):
    for severity in fc.SEVERITIES:
        shift = fc.PARAMS["brightness"][severity - 1]
        assert torch.allclose(fc.corrupt(clean, "brightness", severity, 0), (clean + shift).clamp(0, 1), atol=0)
        factor = fc.PARAMS["contrast"][severity - 1]
        mean = clean.mean(dim=(2, 3), keepdim=True)
        out = fc.corrupt(clean, "contrast", severity, 0)
        assert torch.allclose(out, (clean - mean) * factor + mean, atol=1e-6)
        assert torch.allclose(out.mean(dim=(2, 3)), mean.flatten(1), atol=1e-5)  # the mean is kept
    out = fc.corrupt(clean, "jpeg_compression", 1, 0)  # 8-bit output of a real JPEG round trip
    assert torch.equal((out * 255).round() / 255, out) and not torch.equal(out, clean)
    grey = torch.full((1, 1, 28, 28), 0.5)  # flat images: blur, JPEG and pixelate keep them (up to 8 bits)
    for kind in ("defocus_blur", "motion_blur", "pixelate", "jpeg_compression"):
        assert torch.allclose(fc.corrupt(grey, kind, 5, 0), grey, atol=1 / 255), kind


def test_fog_is_low_frequency_and_noises_are_not(clean):
    """Fog's change from the clean image varies smoothly in space; Gaussian noise's does not."""
    def roughness(kind):
        delta = fc.corrupt(clean, kind, 3, 0) - (1 - 0.5 * (kind == "fog")) * clean
        return float((delta[..., 1:, :] - delta[..., :-1, :]).abs().mean() / delta.abs().mean())
    assert roughness("fog") < 0.2 < roughness("gaussian_noise")


def test_fogs_smoothing_is_the_shared_smooth_field():
    noise = np.random.default_rng(0).standard_normal((2, 28, 28))
    for sigma in fc.FOG_SIGMAS:
        shared = img._smooth_field(torch.tensor(noise, dtype=torch.float32), sigma).double().numpy()
        mine = fc._smoothing_matrix(28, sigma) @ noise @ fc._smoothing_matrix(28, sigma).T
        mine /= mine.reshape(2, -1).std(axis=1, ddof=1)[:, None, None]
        assert np.abs(mine - shared).max() < 1e-5, sigma


def test_fashion_c_streams_are_not_digits_c_streams():
    a = fc.image_rng(0, "gaussian_noise", 1, 0).standard_normal(4)
    b = img.image_rng(0, "gaussian_noise", 1, 0).standard_normal(4)
    assert not np.array_equal(a, b)
