"""`icml soup` on real images: the `real` preset's config (Fashion-MNIST at 28 px, Fashion-MNIST-C) at test
size through the CLI, train → eval → HTML report on the real files of Debian's package; the data the run
scores are the project loader's t10k images and data/fashion_c.py's corruptions, split seen / held-out as
that module says; a missing or damaged --data is one line, exit 2, and no run directory.

Needs Debian's `dataset-fashion-mnist` (`make install` installs it): where it is missing these tests FAIL
with the install hint, never skip."""
from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from conftest import invoke
from icml.data import fashion_c as fc
from icml.data import idx

# the real preset's recipe at test size: 28 px and patch 7 stay, steps and image counts shrink
TINY = ["--set", "stock.steps=4", "--set", "ssl.steps=3", "--set", "ft.steps=3", "--set", "ssl.batch_size=16",
        "--set", "ingredients=mae,mmcr", "--set", "ft.probe_steps=10", "--set", "ft.probe_lrs=0.03",
        "--set", "train_images=200", "--set", "val_images=60", "--set", "eval_test=12", "--set", "eval_val=8",
        "--set", "eval_severities=1,5", "--set", "shift_severities=5", "--set", "season.batch_size=32",
        "--set", "season.epochs=1", "--set", "season.steps_per_epoch=2", "--set", "vit.layers=1",
        "--set", "vit.hidden_size=32", "--set", "vit.intermediate_size=64", "--set", "supervised.seeds=1",
        "--set", "diff_init=false"]


REAL = ["--preset", "real"]


@pytest.fixture(scope="module")
def real_run(fashion_mnist_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    for argv in (["train", *REAL, *TINY], ["eval"], ["report", "--format", "html", "--out", str(runs / "r.html")]):
        result = invoke("soup", *argv, "--runs-dir", runs, "--quiet")
        assert result.code == 0, (argv, result.err)
    (run,) = (runs / "soup").iterdir()
    return run


def test_the_real_preset_is_fashion_mnist_at_28_px_with_fashion_c_held_out():
    from icml.methods.soup.config import corruptions_of, preset, validate

    cfg = preset("real")
    default = preset("default")
    assert (cfg.dataset, cfg.vit.image_size, cfg.vit.patch_size) == ("fashion_mnist", 28, 7)
    assert cfg.heldout == list(fc.HELDOUT) == ["impulse_noise", "fog", "jpeg_compression"]
    assert corruptions_of(cfg) == fc.FASHION_C
    # the default's recipe: the same ingredients, controls, orders and soups
    for key in ("ingredients", "order", "controls", "interpolation", "shift_severities", "eval_severities"):
        assert getattr(cfg, key) == getattr(default, key), key
    validate(cfg)


def test_the_run_scores_the_loaders_images_and_fashion_c(fashion_mnist_dir):
    """prepare_data of the real preset: the clean test images are t10k's first eval_test, the corrupted sets are
    fashion_c.corrupt of them (test ids offset as for digits), U is the seen types' images alone."""
    from icml.methods.soup.config import preset
    from icml.methods.soup.pipeline import TEST_ID_OFFSET, prepare_data

    cfg = preset("real")
    cfg.eval_test, cfg.eval_val, cfg.train_images, cfg.val_images = 20, 10, 300, 50
    cfg.eval_severities = cfg.shift_severities = [2, 4]
    data = prepare_data(cfg, 3, 28, 1)
    t10k = idx.load_fashion_mnist(None)["test"]
    expected = torch.from_numpy(t10k["images"][:20]).float().div(255).unsqueeze(1)
    assert torch.equal(data.test.images, expected) and data.test.labels.tolist() == t10k["labels"][:20].tolist()
    assert (len(data.train), len(data.val)) == (300, 50)
    assert torch.bincount(data.train.labels, minlength=10).tolist() == [30] * 10  # stratified subset
    assert (data.seen, data.heldout) == (list(fc.SEEN), list(fc.HELDOUT))
    assert set(data.test_sets) == {(k, s) for k in fc.FASHION_C for s in (2, 4)}
    ids = [TEST_ID_OFFSET + i for i in range(20)]
    for kind in ("jpeg_compression", "fog", "gaussian_noise"):
        assert torch.equal(data.test_sets[(kind, 4)].images, fc.corrupt(expected, kind, 4, 3, ids))
    assert set(data.val_sets) == {(k, s) for k in fc.SEEN for s in (2, 4)}  # selection never sees held-out types
    pool = torch.cat([fc.corrupt(expected, k, s, 3, ids) for k in fc.SEEN for s in (2, 4)])
    assert torch.equal(data.pool, pool)
    assert {data.benchmark_of(k) for k in fc.FASHION_C} == {"fashion_c"}


def test_train_eval_report_on_the_real_files(real_run):
    frame = pd.read_parquet(real_run / "metrics.parquet")
    record = json.loads((real_run / "config.json").read_text())
    assert record["preset"] == "real" and record["config"]["dataset"] == "fashion_mnist"
    assert record["config"]["vit"]["image_size"] == 28
    test = frame[(frame["phase"] == "eval") & (frame["split"] == "test")]
    per_type = test[(test["metric"] == "corruption_acc") & (test["variant"] == "stock_ft")
                    & (test["corruption"] != "mean") & (test["severity"] != "mean")]
    assert set(per_type["benchmark"]) == {"fashion_c"} and len(per_type) == 10 * 2
    assert set(per_type.loc[per_type["shift"] == "heldout", "corruption"]) == set(fc.HELDOUT)
    assert set(per_type.loc[per_type["shift"] == "seen", "corruption"]) == set(fc.SEEN)
    for variant in ("stock_ft", "self_soup_uniform", "self_soup_greedy", "self_season_soup", "soup_clean_ssl",
                    "best_single_ingredient", "supervised_soup_uniform", "ensemble"):
        means = test[(test["variant"] == variant) & (test["metric"] == "corruption_acc")
                     & (test["corruption"] == "mean")].set_index("shift")["value"]
        assert set(means.index) == {"seen", "heldout", "all"}, variant
        assert ((0 <= means) & (means <= 1)).all()
    html = (real_run.parent.parent / "r.html").read_text()
    for title in ("Variants side by side", "fashion_c seen", "fashion_c heldout", "accuracy by corruption type and severity",
                  "jpeg_compression"):
        assert title in html, title
    assert html.count("data:image/png;base64,") == 7


def test_every_declared_claim_reads_the_real_run(real_run):
    """The group report's claims pin benchmark digits_c or fashion_c: on a real run both arms are fashion_c rows."""
    import numpy as np

    from icml.methods.soup.report import CLAIMS
    from icml.reports.claims import arm_rows, arm_value

    frame = pd.read_parquet(real_run / "metrics.parquet")
    for claim in CLAIMS:
        assert set(arm_rows(frame, claim, claim.a)["benchmark"]) == {"fashion_c"}, claim.name
        a, b = arm_value(frame, claim, claim.a), arm_value(frame, claim, claim.b)
        assert np.isfinite(a) and np.isfinite(b), claim.name


def _damaged_copies(root):
    """Folders that are not Fashion-MNIST: missing, empty, one file missing, a truncated gzip, a label out of range."""
    empty = root / "empty"
    empty.mkdir()
    cases = {"missing": (root / "nowhere", "does not exist"), "empty": (empty, "holds no Fashion-MNIST files")}
    for name in ("one_missing", "truncated", "bad_label"):
        shutil.copytree(idx.DEBIAN_DIR, root / name)
    (root / "one_missing" / "t10k-labels-idx1-ubyte.gz").unlink()
    cases["one_missing"] = (root / "one_missing", "t10k-labels-idx1-ubyte.gz' is missing")
    images = root / "truncated" / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:200_000])
    cases["truncated"] = (root / "truncated", "train-images-idx3-ubyte.gz' is a damaged gzip file")
    import gzip

    labels = root / "bad_label" / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[8 + 5] = 10
    labels.write_bytes(gzip.compress(bytes(raw)))
    cases["bad_label"] = (root / "bad_label", "has label 10 at index 5")
    return cases


def test_a_bad_data_folder_is_one_line_exit_2_and_no_run(fashion_mnist_dir, tmp_path):
    runs = tmp_path / "runs"
    cases = _damaged_copies(tmp_path)
    for name, (folder, message) in cases.items():
        result = invoke("soup", "train", *REAL, *TINY, "--data", folder, "--runs-dir", runs)
        lines = [line for line in result.err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("icml: error:")]
        assert result.code == 2 and len(errors) == 1 and "Traceback" not in result.err, (name, result.err)
        assert message in errors[0], (name, errors[0])
        assert not runs.exists(), name  # refused before a run directory exists
    # the same check guards a seed group before any of its runs
    folder, message = cases["truncated"]
    result = invoke("soup", "train", *REAL, *TINY, "--seeds", "0,1", "--data", folder, "--runs-dir", runs)
    assert result.code == 2 and message in result.err and not runs.exists()
