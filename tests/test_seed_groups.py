"""Seeds as an axis: `--seeds` makes one run per seed recorded as a group; the group report shows every
table as mean ± 95 % t-interval over seeds, judges the method's claims from paired per-seed
differences, and carries the same numbers in --json and groups.parquet; the same seed on the same
machine gives bit-identical metrics."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from icml.reports.claims import (HOLDS, IDENTICAL, NOT_SHOWN, REVERSED, TOO_FEW, Claim, ClaimError, arm_value,
                                 verdict)
from icml.reports.groups import aggregate_table, judge_claims, parse_cell
from icml.reports.stats import t_interval
from icml.reports.tables import Table

T975 = {1: 12.706204736174698, 2: 4.302652729749464, 4: 2.7764451051977934}  # Student-t quantiles (tables)


def test_t_interval_is_the_student_t_interval_of_the_mean():
    mean, low, high, sd, n = t_interval([1.0, 2.0, 3.0])
    assert (mean, sd, n) == (2.0, 1.0, 3)
    assert high - mean == pytest.approx(T975[2] / math.sqrt(3), rel=1e-12)
    assert mean - low == pytest.approx(high - mean, rel=1e-15)
    # two seeds: sd = |a − b|/√2, so the half-width is t(0.975, 1) · |a − b| / 2
    mean, low, high, _, _ = t_interval([0.5, 0.7])
    assert high - low == pytest.approx(T975[1] * 0.2, rel=1e-12)
    values = [0.31, 0.29, 0.35, 0.30, 0.33]
    mean, low, high, sd, n = t_interval(values)
    assert high - mean == pytest.approx(T975[4] * np.std(values, ddof=1) / math.sqrt(5), rel=1e-12)
    # one seed: a mean but no interval; NaN values are not seeds
    assert math.isnan(t_interval([0.4])[1]) and t_interval([0.4, float("nan")])[4] == 1


def test_verdict_needs_the_interval_to_exclude_zero_on_the_claimed_side():
    assert verdict(0.01, 0.05, "higher") == HOLDS
    assert verdict(-0.05, -0.01, "higher") == REVERSED
    assert verdict(-0.01, 0.05, "higher") == NOT_SHOWN
    assert verdict(-0.05, -0.01, "lower") == HOLDS  # lower-is-better metric: a − b < 0 is the claim
    assert verdict(0.0, 0.05, "higher") == NOT_SHOWN  # touching zero does not exclude it
    assert verdict(float("nan"), float("nan"), "higher") == TOO_FEW


def test_a_difference_equal_at_every_seed_is_not_shown_never_holds():
    """Copies of one run (a seed that reaches nothing) give the same difference at every seed: its
    zero-width interval [0.0469, 0.0469] excludes zero, yet it is no evidence."""
    frames = [pd.DataFrame({"phase": "eval", "metric": "auroc", "variant": ["m", "b"], "step": 0,
                            "value": [0.9469, 0.9]}) for _ in range(3)]
    (claim,) = judge_claims([Claim("m beats b", "auroc", "m", "b")], frames, {"auroc": "higher"})
    assert claim["per_seed"] == [claim["per_seed"][0]] * 3 and claim["ci_low"] == claim["ci_high"]
    assert verdict(claim["ci_low"], claim["ci_high"], "higher") == HOLDS  # what the interval alone would say
    assert claim["verdict"] == IDENTICAL
    assert verdict(0.01, 0.05, "higher", [0.02, 0.03, 0.04]) == HOLDS  # differences that vary are judged


def test_a_claim_that_averages_an_unpinned_tag_is_a_declaration_error():
    """event-classify's secnet arm matched its N = 1024 and N = 512 rows and averaged them, silently."""
    frame = pd.DataFrame({"phase": "eval", "metric": "acc", "variant": ["secnet", "secnet", "cnn"],
                          "N": [1024, 512, 1024], "split": "test", "step": 0, "value": [0.9, 0.5, 0.6]})
    pooled = Claim("secnet beats cnn", "acc", "secnet", "cnn")
    with pytest.raises(ClaimError, match=r"averages rows of N = 1024, 512"):
        arm_value(frame, pooled, "secnet")
    (row,) = judge_claims([pooled], [frame, frame], {"acc": "higher"})
    assert row["verdict"].startswith("declaration error") and math.isnan(row["mean"])
    pinned = Claim("secnet beats cnn at N = 1024", "acc", "secnet", "cnn", where={"N": 1024})
    assert arm_value(frame, pinned, "secnet") == 0.9
    on_purpose = Claim("secnet beats cnn, mean over N", "acc", "secnet", {"variant": "cnn"}, pool=("N",))
    assert arm_value(frame, on_purpose, "secnet") == pytest.approx(0.7, abs=1e-15)
    (row,) = judge_claims([on_purpose], [frame, frame], {"acc": "higher"})
    assert row["pooled"] == "mean over N = 1024, 512"


def test_group_text_cells_read_as_each_run_shows_them():
    """A text cell (a range) built at full precision for the means is shown at the run's own precision."""
    full = [Table("t", pd.DataFrame({"case": ["h = 0.01000000000000000021"], "kl": [0.25],
                                     "range": ["1.4900434672165244 – 1.6462874768305062"]}))] * 2
    shown = [Table("t", pd.DataFrame({"case": ["h = 0.01"], "kl": [0.25], "range": ["1.49 – 1.646"]}))] * 2
    table, _ = aggregate_table("t", full, [0, 1], shown=shown)
    assert table.frame.loc[0, "range"] == "1.49 – 1.646"  # a text cell
    assert table.frame.loc[0, "case"] == "h = 0.01"  # a text key naming the row


def test_cells_parse_numbers_percentages_and_within_run_intervals():
    assert parse_cell(0.25) == (0.25, "")
    assert parse_cell("0.731 ± 0.05") == (0.731, "")
    assert parse_cell("97.8 %") == (97.8, " %")
    assert parse_cell("−0.045") == (-0.045, "")
    assert parse_cell("0.0517 [0.049, 0.054]") == (0.0517, "")
    assert parse_cell("1.2e-03") == (0.0012, "")
    assert parse_cell("snapkv") == (None, "snapkv")
    assert parse_cell("0.58 F") == (0.58, " F")  # a number with a short tag (gradient-route's forgotten set)
    assert parse_cell("2 seeds") == (None, "2 seeds")  # a word is text, not a tag
    assert parse_cell("[−0.045, −0.005]")[0] is None  # an interval alone is text, not a number
    assert math.isnan(parse_cell("–")[0])


def test_tables_align_rows_by_their_text_keys_and_keep_constant_cells():
    seed0 = Table("t", pd.DataFrame({"variant": ["a", "b"], "ratio": [0.3, 0.3], "em": ["0.5", "0.7"],
                                     "note": ["x", "y"]}), {"em": "higher"})
    seed1 = Table("t", pd.DataFrame({"variant": ["b", "a"], "ratio": [0.3, 0.3], "em": ["0.9", "0.6"],
                                     "note": ["y", "z"]}))  # rows in another order
    table, cells = aggregate_table("t", [seed0, seed1], [0, 1])
    frame = table.frame.set_index("variant")
    assert frame.loc["a", "ratio"] == "0.3" and frame.loc["b", "note"] == "y"
    assert frame.loc["a", "note"] == "s0: x | s1: z"
    em = {c["row"]: c for c in cells if c["column"] == "em"}
    assert em["a"]["per_seed"] == [0.5, 0.6] and em["b"]["per_seed"] == [0.7, 0.9]
    mean, low, high, _, _ = t_interval([0.7, 0.9])
    assert (em["b"]["mean"], em["b"]["ci_low"], em["b"]["ci_high"]) == (mean, low, high)
    assert frame.loc["b", "em"].startswith("0.8 ± ") and table.better == {"em": "higher"}


def test_rows_whose_text_keys_repeat_align_by_position_and_keep_their_text():
    """kv-compress's bootstrap table: a task per ratio, so `task` alone does not name a row."""
    frames = [pd.DataFrame({"task": ["kv", "kv", "count"], "ratio": [0.1, 0.3, 0.1], "low": [a, b, c]})
              for a, b, c in [(0.1, 0.2, 0.3), (0.3, 0.4, 0.5)]]
    table, cells = aggregate_table("t", [Table("t", f) for f in frames], [0, 1])
    assert list(table.frame["task"]) == ["kv", "kv", "count"] and list(table.frame["ratio"]) == ["0.1", "0.3", "0.1"]
    low = {c["row"]: c["per_seed"] for c in cells if c["column"] == "low"}
    assert low == {"kv · 0": [0.1, 0.3], "kv · 1": [0.2, 0.4], "count · 2": [0.3, 0.5]}


def test_a_note_that_differs_by_seed_says_whose_it_is():
    frame = pd.DataFrame({"variant": ["a"], "em": [0.5]})
    same, _ = aggregate_table("t", [Table("t", frame, note="n = 5"), Table("t", frame, note="n = 5")], [0, 1])
    assert same.note.startswith("per run: n = 5 — here:")
    differ, _ = aggregate_table("t", [Table("t", frame, note="n = 5"), Table("t", frame, note="n = 1")], [2, 3])
    assert differ.note.startswith("per run: n = 5 (seed 2's; it differs by seed) — here:")


def test_tagged_numbers_aggregate_when_every_seed_has_the_same_tag():
    seed0 = Table("t", pd.DataFrame({"variant": ["a", "b"], "cr": ["0.5 F", "0.9 R"]}))
    seed1 = Table("t", pd.DataFrame({"variant": ["a", "b"], "cr": ["0.7 F", "0.8 F"]}))
    table, cells = aggregate_table("t", [seed0, seed1], [0, 1])
    frame = table.frame.set_index("variant")
    assert frame.loc["a", "cr"].startswith("0.6 ± ") and frame.loc["a", "cr"].endswith(" F")
    assert frame.loc["b", "cr"] == "s0: 0.9 R | s1: 0.8 F"  # tags differ: per seed, as text
    assert [c["per_seed"] for c in cells] == [[0.5, 0.7]]


def test_claim_arms_are_means_of_their_matching_rows():
    frame = pd.DataFrame({"phase": "eval", "metric": "em", "variant": ["x", "x", "y", "y", "x"],
                          "task": ["t1", "t2", "t1", "t2", "t1"], "ratio": [0.3, 0.3, 0.3, 0.3, 0.5],
                          "step": 0, "value": [0.2, 0.4, 0.1, 0.1, 0.9]})
    claim = Claim("x beats y, mean over tasks", "em", "x", "y", where={"ratio": 0.3}, pool=("task",))
    assert arm_value(frame, claim, "x") == pytest.approx(0.3, abs=1e-15)
    assert arm_value(frame, claim, {"variant": "y", "task": "t2"}) == 0.1
    assert math.isnan(arm_value(frame, Claim("c", "em", "z", "y"), "z"))


@pytest.fixture
def toy_claims(toy, monkeypatch):
    """The toy method with one claim: momentum's test MSE below plain SGD's."""
    import importlib

    report = importlib.import_module("toy_method.report")
    monkeypatch.setattr(report, "CLAIMS", [Claim("momentum beats sgd", "mse", "momentum", "sgd")], raising=False)
    return toy


def test_seeds_make_a_group_whose_report_carries_every_number(icml, toy_claims, tmp_path):
    result = icml("toy", "train", "--preset", "smoke", "--seeds", "0,1,2", "--json")
    assert result.code == 0, result.err
    doc = result.json()
    group = doc["group"]
    runs = [Path(r["run_dir"]) for r in doc["runs"]]
    infos = [json.loads((run / "run.json").read_text()) for run in runs]
    assert [i["seed"] for i in infos] == [0, 1, 2] and {i["group"] for i in infos} == {group}
    assert icml("toy", "train", "--preset", "smoke", "--seed", "5").code == 0  # not in the group

    result = icml("toy", "eval", "--group", group, "--json")
    assert result.code == 0, result.err
    assert [r["seed"] for r in result.json()["runs"]] == [0, 1, 2]

    result = icml("report", "--group", group, "--json")
    assert result.code == 0, result.err
    report = result.json()
    assert report["group"]["seeds"] == [0, 1, 2] and "Student-t" in report["group"]["interval"]
    frames = [pd.read_parquet(run / "metrics.parquet") for run in runs]
    mse = {v: [float(f.loc[(f.phase == "eval") & (f.variant == v), "value"].iloc[0]) for f in frames]
           for v in ("sgd", "momentum")}
    (claim,) = report["claims"]
    diffs = [m - s for m, s in zip(mse["momentum"], mse["sgd"])]  # paired by seed, from the raw metrics
    mean, low, high, _, _ = t_interval(diffs)
    assert claim["per_seed"] == diffs and (claim["mean"], claim["ci_low"], claim["ci_high"]) == (mean, low, high)
    assert claim["verdict"] == verdict(low, high, "lower") and claim["expect"] == "a − b < 0"
    (eval_table,) = [t for t in report["tables"] if t["title"] == "eval metrics"]
    for cell in eval_table["cells"]:  # table cells: each seed's tables are read at full precision
        assert cell["per_seed"] == mse[cell["row"]]
        assert cell["mean"] == pytest.approx(np.mean(cell["per_seed"]), rel=1e-14)

    parquet = pd.read_parquet(report["group"]["groups_parquet"])
    assert set(parquet["kind"]) == {"claim", "cell"} and (parquet["group_id"] == group).all()
    row = parquet[parquet["kind"] == "claim"].iloc[0]
    assert (row["mean"], row["ci_low"], row["ci_high"], row["verdict"]) == (mean, low, high, claim["verdict"])
    assert list(row["per_seed"]) == diffs
    assert (Path(report["group"]["groups_parquet"]).parent / "report.html").exists()

    # the same group through the method's report, by seeds, and the root report by method + preset
    by_seeds = icml("toy", "report", "--seeds", "0,1,2", "--json").json()
    assert by_seeds["claims"][0]["per_seed"] == diffs
    result = icml("report", "--method", "toy", "--preset", "smoke", "--format", "markdown")
    assert result.code == 0, result.err
    assert "claims (paired differences over seeds)" in result.out and "momentum beats sgd" in result.out
    by_preset = icml("report", "--method", "toy", "--preset", "smoke", "--json").json()
    assert by_preset["group"]["seeds"] == [0, 1, 2]  # seed 5's run has no eval: not a seed of the report


@pytest.mark.parametrize("argv, problem", [
    (["toy", "train", "--seeds", "0,x"], "not a comma-separated list"),
    (["toy", "train", "--seeds", "1,1"], "repeats a seed"),
    (["toy", "train", "--seeds", "0,1", "--seed", "2"], "--seeds starts one new run per seed"),
    (["toy", "eval", "--group", "nope"], "no runs of group 'nope'"),
    (["toy", "report", "--seeds", "0,1"], "no group of toy"),
    (["report", "--preset", "smoke"], "takes --group G, or --method M"),
])
def test_bad_seed_input_is_one_line(icml, toy, argv, problem):
    result = icml(*argv)
    assert result.code == 2 and problem in result.err
    assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err


def test_seeds_refuse_a_method_that_is_deterministic_by_design(toy, tmp_path):
    import dataclasses

    from icml.cli import lifecycle, registry
    from icml.cli.errors import UsageError
    from icml.cli.runstore import RunStore

    method = dataclasses.replace(registry.get("toy"), deterministic="closed forms only")
    with pytest.raises(UsageError, match=r"same results at every seed \(closed forms only\)") as caught:
        lifecycle.train_seeds(method, RunStore(tmp_path / "runs"), seeds=[0, 1], preset="smoke", device="cpu",
                              config_file=None, overrides=[])
    assert "without --seeds" in caught.value.line() and not (tmp_path / "runs").exists()


def _values(run: Path) -> pd.DataFrame:
    frame = pd.read_parquet(run / "metrics.parquet")
    return frame.drop(columns=["run_id"]).sort_values(["phase", "variant", "metric", "step"]).reset_index(drop=True)


def test_the_same_seed_on_this_machine_is_bit_identical(icml):
    """single-index's smoke config, trained twice at seed 0 and once at seed 1 in one process."""
    group = icml("single-index", "train", "--preset", "smoke", "--seeds", "0,1", "--json").json()
    again = icml("single-index", "train", "--preset", "smoke", "--seed", "0", "--json").json()
    first, other = (Path(r["run_dir"]) for r in group["runs"])
    a, b = _values(first), _values(Path(again["run_dir"]))
    assert len(a) > 0
    pd.testing.assert_frame_equal(a, b, check_exact=True)  # every value, bit for bit
    assert not np.array_equal(a["value"].to_numpy(), _values(other)["value"].to_numpy())


def test_a_train_claim_reads_the_last_step_of_the_rows_it_names():
    """Two experiments of one variant end at different steps: a claim pinned to the shorter one reads its
    last step (taking the variant's last step over both experiments dropped it)."""
    frame = pd.DataFrame({"phase": "train", "metric": "coverage", "variant": ["g", "g", "g", "g"],
                          "env": ["rooms", "rooms", "door", "door"], "step": [4096, 8192, 8192, 16384],
                          "value": [0.5, 0.8, 0.6, 0.9]})
    claim = Claim("g covers rooms", "coverage", "g", "v", where={"env": "rooms"}, phase="train")
    assert arm_value(frame, claim, "g") == 0.8
