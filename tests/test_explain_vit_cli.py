"""`icml explain-vit` end to end at a test-sized config built from the smoke preset: train → eval → report
(every arm, every spec metric and tag, per_image.parquet), the explain verb on user images through the run
and through --model, a user image folder, and bad input (one line, non-zero exit)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import invoke
from plotcheck import shown_texts

ARMS = ["input_x_grad", "weff", "weff_eq", "weff_eq_lp", "dave_nopost", "dave", "saliency",
        "integrated_gradients", "smoothgrad", "attn_rollout", "gae", "gradcam", "random"]
TINY = ["--preset", "smoke", "--set", "data_cfg.n_train=256", "--set", "data_cfg.n_test=12",
        "--set", "data_cfg.n_val=12", "--set", "data_cfg.n_montages=2", "--set", "data_cfg.n_val_montages=1",
        "--set", "vit.hidden_size=32", "--set", "vit.layers=2", "--set", "vit.heads=2",
        "--set", "vit.intermediate_size=64", "--set", "dave.n_samples=3", "--set", "eval.n_test_images=4",
        "--set", "eval.ig_steps=3", "--set", "eval.smoothgrad_n=3", "--set", "eval.deletion_images=2",
        "--set", "eval.deletion_steps=4", "--set", "eval.stability_images=2", "--set", "eval.shifts=1",
        "--set", "eval.gallery=1", "--set", "eval.fills=blur,constant", "--set", f"eval.arms={','.join(ARMS)}"]
SPEC_METRICS = {"grid_pg", "energy_pg", "pointing_game", "pixel_auroc", "deletion_lerf_auc", "deletion_morf_auc",
                "insertion_auc", "stability_noise", "stability_shift", "lattice_energy", "lattice_grad_ratio",
                "class_sensitivity", "completeness_gap", "opvar_ratio", "wall_s_per_image", "n_backward"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    trained = invoke("explain-vit", "train", *TINY, "--runs-dir", runs, "--json")
    assert trained.code == 0, trained.err
    path = Path(trained.json()["run_dir"])
    evaluated = invoke("explain-vit", "eval", path, "--runs-dir", runs, "--json")
    assert evaluated.code == 0, evaluated.err
    report = invoke("explain-vit", "report", path, "--runs-dir", runs, "--format", "html", "--out", runs / "r.html")
    assert report.code == 0, report.err
    return path


def test_every_arm_metric_tag_and_table(run):
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    test = frame[(frame["phase"] == "eval") & (frame["split"] == "test")]
    classifier, test = test[test["variant"] == "classifier"], test[test["variant"] != "classifier"]
    assert SPEC_METRICS <= set(test["metric"])
    assert set(test["variant"]) == set(ARMS)
    assert {"lerf", "morf"} == set(test["direction"].dropna()) and {"blur", "constant"} == set(test["fill"].dropna())
    assert set(test["input"]) == {"single", "montage"} and set(test["shift_px"].dropna()) == {1}
    assert (test["n_samples"] == 3).all() and test["alpha_max"].notna().all() and (test["model"] == "toy_vit").all()
    sweep = frame[(frame["phase"] == "eval") & (frame["split"] == "val")]
    assert set(sweep["alpha_max"]) == {0.1, 0.3} and set(sweep["metric"]) == {"grid_pg"}
    gap = test[test["metric"] == "completeness_gap"].set_index("variant")["value"]
    assert gap["weff"] < 1e-4 < gap["input_x_grad"]  # float32 model: W_eff⊙x is complete, ∇⊙x is not
    grid = test[test["metric"] == "grid_pg"]["value"]
    assert grid.dropna().between(0, 1).all() and grid.notna().sum() >= len(ARMS) - 2  # NaN: no positive mass
    per_image = pq.read_table(run / "per_image.parquet").to_pandas()
    # what the model is confident on: one count per class, at least the images explained; the montages built
    confident = classifier[classifier["metric"] == "n_confident"].set_index("class_name")["value"]
    explained = per_image[(per_image["variant"] == "dave") & (per_image["metric"] == "energy_pg")]
    assert len(confident) == 6 and confident.sum() >= len(explained) > 0
    montages = classifier[classifier["metric"] == "n_montages"]["value"]
    grid_images = per_image[(per_image["variant"] == "dave") & (per_image["metric"] == "grid_pg")]
    assert list(montages) == [float(len(grid_images))]
    assert list(per_image.columns) == ["run_id", "variant", "image_id", "target", "metric", "value"]
    assert set(per_image["variant"]) == set(ARMS) and "grid_pg" in set(per_image["metric"])
    for name in ("curves", "spectra"):
        assert (run / f"{name}.parquet").exists()
    html = (run.parent.parent / "r.html").read_text()
    assert "Ablation ladder" in html and "Confidently correct test images per class" in html
    assert "map gallery" in html and "data:image/png;base64" in html
    assert (run / "report" / "map_gallery_montage.png").exists()


def test_plots_are_readable_on_the_html_page(run):
    """Every plot as the HTML page shows it has text ≥ 8 pt (the galleries' labels were 7 pt on a figure shrunk to
    half its size: ~3 pt); the α_max sweep's GridPG axis spans [0, 1] with each value written beside its point,
    not a 3e-4 range stretched over the whole axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icml.cli import registry
    from icml.cli.lifecycle import config_from_run
    from icml.cli.results import metrics_schema, read_metrics
    from icml.cli.runstore import Run
    from icml.methods.explain_vit.report import plots
    from icml.reports.tables import fmt

    method = registry.get("explain-vit")
    cfg, _, _ = config_from_run(method, Run(run))
    frame = read_metrics(run / "metrics.parquet", metrics_schema(method.tags))
    figures = dict(plots(frame, cfg, run=Run(run)))
    assert {"map gallery single", "map gallery montage", "alpha_max sweep"} <= set(figures)
    for title, figure in figures.items():
        small = [(t, round(size, 1)) for t, size in shown_texts(figure) if t and size < 8]
        assert not small, (title, small)
    sweep = figures["alpha_max sweep"].axes[0]
    low, high = sweep.get_ylim()
    assert low <= 0 and high >= 1
    values = frame[(frame["split"] == "val") & (frame["metric"] == "grid_pg")].groupby("alpha_max")["value"].mean()
    texts = {t.get_text() for t in sweep.texts}
    assert {fmt(v, 3) for v in values} <= texts
    plt.close("all")


def test_report_says_when_no_montage_could_be_built():
    """A model confident on fewer than four classes gives no montage: the report names the cause."""
    import pandas as pd

    from icml.methods.explain_vit.report import _confidence_table

    rows = [dict(phase="eval", variant="classifier", metric="n_confident", value=v, class_name=c, run_id="r")
            for c, v in [("disk", 0.0), ("ring", 3.0), ("bar_pair", 40.0)]]
    frame = pd.DataFrame(rows + [dict(phase="eval", variant="classifier", metric="n_montages", value=0.0,
                                      class_name=None, run_id="r")])
    note = _confidence_table(frame[frame["metric"] == "n_confident"], frame).note
    assert "confident on 2 classes (4 needed)" in note and "not measured" in note
    frame.loc[frame["metric"] == "n_montages", "value"] = 5.0
    assert "not measured" not in _confidence_table(frame[frame["metric"] == "n_confident"], frame).note


def test_report_names_the_images_behind_each_runs_means_and_omits_an_empty_montage_table():
    """A seed confident on one image puts that image's scores into the group mean: the note gives the count per
    run (capped at eval.n_test_images); with no montage scored, no blank montage table is drawn."""
    import pandas as pd

    from icml.methods.explain_vit.config import preset
    from icml.methods.explain_vit.report import tables

    cfg = preset("default")
    confident = {"a": [("ring", 0.0), ("bar_pair", 53.0)], "b": [("ring", 0.0), ("bar_pair", 1.0)],
                 "c": [("ring", 200.0), ("bar_pair", 400.0)]}
    rows = [dict(phase="eval", variant="classifier", metric="n_confident", value=v, class_name=c, run_id=r)
            for r, counts in confident.items() for c, v in counts]
    rows += [dict(phase="eval", variant="classifier", metric="n_montages", value=0.0, run_id=r) for r in confident]
    rows += [dict(phase="eval", variant="dave", metric="energy_pg", value=0.5, run_id=r, alpha_max=0.1)
             for r in confident]
    frame = pd.DataFrame(rows).assign(split="test", fill=None)
    frame["seed"] = frame["run_id"].map({"a": 0, "b": 1, "c": 2})
    out = tables(frame, cfg)
    single = next(t for t in out if t.title.startswith("Single images"))
    assert f"test images (53, 1, {cfg.eval.n_test_images} explained)" in single.note
    assert not any(t.title.startswith("Montages") for t in out)


def test_explain_verb_through_run_and_model(run, tmp_path):
    from PIL import Image

    from icml.methods.explain_vit.data import make_image

    image, label, _, _ = make_image(0, "test", 0, 32)
    path = tmp_path / "a.png"
    Image.fromarray((image.transpose(1, 2, 0) * 255).astype(np.uint8)).resize((48, 48)).save(path)
    out = tmp_path / "maps"
    done = invoke("explain-vit", "explain", run, "--image", path, "--target", str(label), "--n", "2",
                  "--out", out, "--runs-dir", run.parent.parent, "--json")
    assert done.code == 0, done.err
    (item,) = done.json()["images"]
    m = np.load(item["npy"])
    assert m.shape == (32, 32) and m.max() == pytest.approx(1.0) and m.min() >= 0  # dave is post-processed
    assert Path(item["heatmap"]).exists() and Path(item["overlay"]).exists()
    done = invoke("explain-vit", "explain", "--model", run / "checkpoints" / "model", "--image", path,
                  "--method", "gae", "--out", out, "--json")
    assert done.code == 0, done.err
    assert done.json()["images"][0]["class"] in {"disk", "square", "triangle", "cross", "ring", "bar_pair"}


def test_user_folder_loads_masks_labels_and_boxes(tmp_path):
    from PIL import Image

    from icml.methods.explain_vit.data import CLASSES, load_folder, make_image

    rows = ["file,label,x0,y0,x1,y1"]
    for i in range(3):
        image, label, mask, box = make_image(1, "test", i, 32)
        Image.fromarray((image.transpose(1, 2, 0) * 255).round().astype(np.uint8)).save(tmp_path / f"im{i}.png")
        Image.fromarray(mask.astype(np.uint8) * 255).save(tmp_path / f"im{i}_mask.png")
        rows.append(f"im{i}.png,{CLASSES[label] if i else label},{box[0]},{box[1]},{box[2]},{box[3]}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    folder = load_folder(tmp_path, 32, CLASSES)
    for i in range(3):
        image, label, mask, box = make_image(1, "test", i, 32)
        assert folder.labels[i] == label and np.array_equal(folder.masks[i], mask)
        assert np.array_equal(folder.boxes[i], box)
        np.testing.assert_allclose(folder.images[i], image, atol=0.5 / 255 + 1e-6)  # 8-bit PNG rounding


@pytest.mark.parametrize("argv, needle", [
    (["train", "--set", "eval.arms=dave,lime"], "unknown or no arm"),
    (["train", "--set", "data_cfg.montage_mode=tile"], "montage_mode"),
    (["train", "--set", "dave.alpha_grid=0.1,1.5"], "[0, 1)"),
    (["train", "--model", "/nonexistent/model"], "does not exist"),
    (["train", "--data", "."], "needs a model"),
])
def test_bad_input_one_line(icml, argv, needle):
    result = icml("explain-vit", *argv, "--preset", "smoke")
    assert result.code == 2 and needle in result.err and "Traceback" not in result.err
    assert len([line for line in result.err.splitlines() if line.startswith("icml: error")]) == 1


def test_bad_images_for_explain(run, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    result = invoke("explain-vit", "explain", run, "--image", broken, "--out", tmp_path, "--runs-dir", run.parent.parent)
    assert result.code != 0 and "cannot be read" in result.err and "Traceback" not in result.err
    result = invoke("explain-vit", "explain", run, "--image", tmp_path / "missing.png", "--runs-dir", run.parent.parent)
    assert result.code == 2 and "does not exist" in result.err


def test_montage_pool_draws_more_cells_until_enough_are_confident(monkeypatch):
    """A model confident on few images still gets montages of once-used confident cells: candidate cells are drawn
    in rounds of 4·n (the first round is the single pool used before) until 4·n pass the filter."""
    from icml.methods.explain_vit import pipeline
    from icml.methods.explain_vit.config import preset

    cfg = preset("default")
    seen: list[list[str]] = []

    def every_seventh(classifier, images, labels, min_conf, device, require_correct=True):
        seen.append(list(labels))
        index = np.arange(len(labels))
        offset = sum(len(s) for s in seen[:-1])  # the filter keeps cells whose running index is a multiple of 7
        return index[(index + offset) % 7 == 0], np.ones(len(labels))

    monkeypatch.setattr(pipeline, "confident", every_seventh)
    montages = pipeline._montage_pool(cfg, 0, None, "montage", 3, "cpu", "m")
    assert [len(s) for s in seen] == [24] * 4  # 4 + 3 + 4 + 3 kept: 14 ≥ 12 after four rounds
    assert len(montages.ids) == 3 and montages.images.shape == (3, 3, 64, 64)
    assert all(len(set(row)) == 4 for row in montages.classes)  # four distinct classes per montage
    # the rounds continue the same deterministic stream: round k holds cells 24k … 24k + 23
    first = pipeline.synthetic(0, "montage", 48, 32)
    assert seen[0] + seen[1] == list(first.labels)
