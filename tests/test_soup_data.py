"""`icml soup` data: the digits split, the corruption suite (deterministic, order-free, severity-
monotone, clipped; held-out types never in U) and the user folder loaders incl. malformed folders."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icml.data import images as img


@pytest.fixture(scope="module")
def digits():
    return img.digits_splits(0)


def test_digits_split_sizes_range_and_stratification(digits):
    assert [len(digits[s]) for s in ("train", "val", "test")] == [1000, 297, 500]
    assert digits["train"].images.shape[1:] == (1, 16, 16)
    for split in digits.values():
        assert float(split.images.min()) >= 0 and float(split.images.max()) <= 1
    counts = np.bincount(digits["test"].labels.numpy(), minlength=10)
    assert counts.min() >= 45 and counts.max() <= 55  # stratified: ~50 per class
    again = img.digits_splits(0)
    assert torch.equal(again["val"].images, digits["val"].images)


@pytest.mark.parametrize("kind", img.CORRUPTIONS)
def test_corruptions_are_deterministic_clipped_and_severity_monotone(digits, kind):
    x = digits["test"].images[:160]
    change = []
    for severity in img.SEVERITIES:
        out = img.corrupt(x, kind, severity, seed=3)
        if severity == 3:
            assert torch.equal(out, img.corrupt(x, kind, severity, seed=3))
        assert float(out.min()) >= 0 and float(out.max()) <= 1 and out.shape == x.shape
        change.append(float((out - x).abs().mean()))
    assert all(a < b for a, b in zip(change, change[1:])), (kind, change)


@pytest.mark.parametrize("kind", [k for k in img.CORRUPTIONS if k not in ("stickers", "mosaic")])
def test_corruption_of_an_image_does_not_depend_on_its_batch(digits, kind):
    x = digits["test"].images[:12]
    full = img.corrupt(x, kind, 4, seed=1)
    order = [7, 2, 11]
    alone = img.corrupt(x[order], kind, 4, seed=1, ids=order)
    assert torch.equal(alone, full[order])


def test_donor_corruptions_take_other_images_and_seeds_matter(digits):
    x = digits["test"].images[:10]
    for kind in ("stickers", "mosaic"):
        out = img.corrupt(x, kind, 5, seed=0)
        assert not torch.equal(out, x)
        assert not torch.equal(out, img.corrupt(x, kind, 5, seed=1))
    with pytest.raises(ValueError, match="unknown corruption"):
        img.corrupt(x, "frost", 1, 0)


def test_heldout_types_never_reach_the_unlabelled_pool():
    from icml.methods.soup.config import preset
    from icml.methods.soup.pipeline import prepare_data

    cfg = preset("smoke")
    cfg.eval_test, cfg.eval_val, cfg.shift_severities, cfg.eval_severities = 8, 4, [2], [2]
    data = prepare_data(cfg, 0, 16, 1)
    assert set(data.heldout) == set(img.HELDOUT) and not set(data.seen) & set(img.HELDOUT)
    expected = torch.cat([data.test_sets[(k, 2)].images for k in data.seen])
    assert torch.equal(data.pool, expected) and len(data.pool) == 8 * 10
    assert all(k in data.seen for k, _ in data.val_sets)


def write_png(path, value: int, size: int = 10):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path)


def test_image_folder_with_and_without_split_folders(tmp_path):
    for c, value in (("cat", 40), ("dog", 200)):
        for i in range(8):
            write_png(tmp_path / "flat" / c / f"{i}.png", value)
    splits, classes = img.load_image_folder(tmp_path / "flat", size=8, channels=1, seed=0)
    assert classes == ["cat", "dog"] and sum(len(s) for s in splits.values()) == 16
    assert splits["train"].images.shape[1:] == (1, 8, 8)
    cat = splits["train"].images[splits["train"].labels == 0]
    assert torch.allclose(cat, torch.full_like(cat, 40 / 255), atol=1e-6)
    for split in ("train", "val", "test"):
        for c in ("a", "b"):
            write_png(tmp_path / "split" / split / c / "x.png", 90)
    splits, classes = img.load_image_folder(tmp_path / "split", size=8, channels=3, seed=0)
    assert classes == ["a", "b"] and len(splits["val"]) == 2 and splits["val"].images.shape[1] == 3


def test_malformed_image_folders_give_one_line_errors(tmp_path):
    with pytest.raises(img.ImageDataError, match="is not a directory"):
        img.load_image_folder(tmp_path / "missing", 8, 1, 0)
    write_png(tmp_path / "one" / "only" / "a.png", 1)
    with pytest.raises(img.ImageDataError, match="at least two class subfolders"):
        img.load_image_folder(tmp_path / "one", 8, 1, 0)
    for c in ("a", "b"):
        for i in range(4):
            write_png(tmp_path / "bad" / c / f"{i}.png", 1)
    (tmp_path / "bad" / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(img.ImageDataError, match="broken.png' cannot be read") as error:
        img.load_image_folder(tmp_path / "bad", 8, 1, 0)
    assert "\n" not in str(error.value)


def test_shift_folder_unlabelled_and_imagenet_c_layout(tmp_path):
    for i in range(3):
        write_png(tmp_path / "pool" / "any" / f"{i}.jpg", 10 * i)
    shift = img.load_shift_folder(tmp_path / "pool", 8, 1, ["a", "b"])
    assert shift.sets is None and shift.pool.shape == (3, 1, 8, 8)
    for kind in ("blur", "noise"):
        for severity in ("1", "3"):
            for c in ("a", "b"):
                write_png(tmp_path / "c" / kind / severity / c / "0.png", 50)
    shift = img.load_shift_folder(tmp_path / "c", 8, 1, ["a", "b"])
    assert sorted(shift.sets) == [("blur", 1), ("blur", 3), ("noise", 1), ("noise", 3)]
    assert shift.sets[("noise", 3)].labels.tolist() == [0, 1]
    write_png(tmp_path / "c" / "noise" / "3" / "zebra" / "0.png", 50)
    with pytest.raises(img.ImageDataError, match=r"classes \['zebra'\] not in the clean data"):
        img.load_shift_folder(tmp_path / "c", 8, 1, ["a", "b"])
    write_png(tmp_path / "d" / "noise" / "9" / "a" / "0.png", 50)
    with pytest.raises(img.ImageDataError, match="not a severity folder 1–5"):
        img.load_shift_folder(tmp_path / "d", 8, 1, ["a", "b"])
