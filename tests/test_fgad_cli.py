"""`icml fgad` end to end on a tiny graph: train → eval → report through the CLI, every spec
metric/tag/table present, communication identities, user graph files, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import train_and_eval, train_eval_report
from plotcheck import figures_of, plot_defects

TINY = ["--preset", "smoke", "--set", "n_nodes=300", "--set", "rounds=2", "--set", "epochs=3", "--set", "K=1,3",
        "--set", "hidden=16", "--set", "out_dim=8"]
SPEC_METRICS = {"auroc", "ap", "recall_at_k", "val_auroc", "comm_bytes_per_round", "comm_bytes_total",
                "params_shared", "params_private", "wall_s", "cut_edge_frac", "u_density", "loss"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return train_eval_report("fgad", tmp_path_factory.mktemp("runs"), TINY)


@pytest.fixture(scope="module")
def metrics(tiny_run):
    return pq.read_table(tiny_run / "metrics.parquet").to_pandas()


def test_every_variant_metric_and_tag(metrics):
    from icml.methods.fgad.config import VARIANTS

    assert SPEC_METRICS <= set(metrics["metric"])
    assert set(metrics["variant"]) == set(VARIANTS)  # partition_metis included: pymetis is a dependency
    scored = metrics[metrics["metric"] == "auroc"]
    assert set(scored["group"]) == {"all", "str_strong", "str_weak", "ctx_strong", "ctx_weak",
                                    "str_strong_intact", "str_weak_intact"}  # the last two: diagnostic
    # at K=1 no clique is split, so a structural group and its intact members differ at most by the members
    # whose clique edges were all dropped (none in a strong clique)
    k1 = scored[(scored["K"] == 1) & scored["group"].isin(["str_strong", "str_strong_intact"])]
    k1 = k1.pivot_table(index=["variant", "agg"], columns="group", values="value")
    np.testing.assert_array_equal(k1["str_strong"], k1["str_strong_intact"])
    assert set(scored["agg"]) == {"client_weighted", "pooled"}
    assert scored[["K", "partition", "dataset", "inject_id"]].notna().all().all()
    assert set(scored.loc[scored["variant"] == "mvfgad", "K"]) == {1, 3}
    assert set(scored.loc[scored["variant"] == "central_mvfgad", "K"]) == {1}
    assert set(scored.loc[scored["variant"] == "partition_random", "partition"]) == {"random"}
    assert set(scored.loc[scored["variant"] == "partition_metis", "partition"]) == {"metis"}
    assert scored["value"].dropna().between(0, 1).all()
    assert scored.loc[scored["group"] == "all", "value"].notna().all()  # a group may miss the tiny test splits
    loss = metrics[metrics["metric"] == "loss"]
    assert set(loss["phase"]) == {"train"} and set(loss["stage"]) == {"fedavg", "local"}
    # at K=1 the client-weighted and pooled numbers coincide
    k1 = scored[scored["K"] == 1].pivot_table(index=["variant", "group"], columns="agg", values="value")
    np.testing.assert_allclose(k1["client_weighted"], k1["pooled"], rtol=1e-12)


def test_communication_identities(metrics):
    diag = metrics[metrics["split"] == "diag"].pivot_table(index=["variant", "K"], columns="metric", values="value")
    for k in (1, 3):
        mv, gcn = diag.loc[("mvfgad", k)], diag.loc[("fedavg_gcn", k)]
        assert mv["comm_bytes_per_round"] == gcn["comm_bytes_per_round"] == 2 * k * mv["params_shared"] * 4
        assert mv["comm_bytes_total"] == 2 * mv["comm_bytes_per_round"]  # 2 rounds
        assert mv["params_private"] > 0 and diag.loc[("local_only", k)]["comm_bytes_total"] == 0
    assert diag.loc[("central_mvfgad", 1)]["comm_bytes_total"] == 0
    assert diag.loc[("mvfgad", 1)]["cut_edge_frac"] == 0 and diag.loc[("mvfgad", 3)]["cut_edge_frac"] > 0


def test_tables_and_run_record(tiny_run, metrics):
    partition = pq.read_table(tiny_run / "partition.parquet").to_pandas()
    assert {"node_id", "client", "split", "moved", "K", "seed", "partition"} <= set(partition.columns)
    for _, rows in partition.groupby(["K", "seed", "partition"]):
        assert sorted(rows["node_id"]) == list(range(300))
    injection = pq.read_table(tiny_run / "injection.parquet").to_pandas()
    assert {"node_id", "group", "atype", "strength", "clique_id", "source_node", "m", "p_drop", "k"} <= set(
        injection.columns)
    assert injection["node_id"].is_unique and set(injection["group"]) == {"str_strong", "str_weak", "ctx_strong",
                                                                          "ctx_weak"}
    clients = pq.read_table(tiny_run / "client_metrics.parquet").to_pandas()
    assert {"run_id", "variant", "seed", "K", "client", "n_nodes", "n_anom", "group", "auroc", "ap"} <= set(
        clients.columns)
    histogram = pq.read_table(tiny_run / "score_histogram.parquet").to_pandas()
    assert set(histogram["group"]) == {"normal", "str_strong", "str_weak", "ctx_strong", "ctx_weak"}
    for _, curve in histogram.groupby("group"):  # a density over 20 bins of width 0.05
        assert curve["density"].sum() * 0.05 == pytest.approx(1.0, abs=1e-9)
    info = json.loads((tiny_run / "run.json").read_text())["injection"]
    params = info["groups_per_seed"]["123"]
    assert params["m_strong"] == 15 and params["p_drop_weak"] == 0.5 and params["seed"] == 123
    assert set(metrics["inject_id"].dropna()) == {params["inject_id"]}
    assert (tiny_run / "checkpoints" / "mvfgad_louvain_K3_s123" / "global_gcn.pt").exists()
    assert (tiny_run / "checkpoints" / "mvfgad_louvain_K3_s123" / "clients.pt").exists()


def test_report_renders(tiny_run):
    html = (tiny_run.parent.parent / "r.html").read_text()
    titles = ("AUROC per anomaly group", "AP per anomaly group", "Ablations — AUROC at K=3", "Communication and cost",
              "Structural groups: all members vs intact cliques")
    for title in titles:
        assert title in html
    assert html.count("data:image/png;base64,") == 5


def test_report_plots_have_data_room_and_no_legend_over_them(tiny_run):
    """Seen in a browser: the weak-vs-strong legend over a bar; client sizes drawn as a line along a client index
    (which has no order of its own): now a bar per client, largest first, a group per K."""
    figures = dict(figures_of("fgad", tiny_run))
    assert [d for title, figure in figures.items() for d in plot_defects(title, figure)] == []
    (axis,) = [ax for ax in figures["partition statistics"].axes if ax.get_title().startswith("Client sizes")]
    clients = pq.read_table(tiny_run / "client_metrics.parquet").to_pandas()
    sizes = clients[(clients["variant"] == "mvfgad") & (clients["group"] == "all")]
    sizes = sizes[sizes["seed"] == sizes["seed"].min()]
    assert sorted(bar.get_height() for bar in axis.patches) == sorted(sizes["n_nodes"])
    assert [line for line in axis.get_lines() if len(line.get_xdata()) > 1] == []
    assert [t.get_text() for t in axis.get_xticklabels()] == [f"K={k}" for k in sorted(sizes["K"].unique())]


def _npz_graph(path: Path) -> Path:
    from icml.data.graphs import InjectionParams, synthetic_graph

    data, _ = synthetic_graph(160, 4, 9.0, 1.0, 8, 0.5, 0.5, InjectionParams(seed=0, fraction=0.03))
    np.savez(path, x=data.x.numpy(), y=data.y.numpy(), edge_index=data.edge_index.numpy())
    return path


def test_user_graph_file(icml, tmp_path):
    graph = _npz_graph(tmp_path / "tiny_graph.npz")
    run = train_and_eval(icml, "fgad", "--preset", "smoke", "--data", graph, "--set", "K=2",
                         "--set", "variants=mvfgad,local_only", "--set", "rounds=1", "--set", "epochs=2")
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    scored = frame[frame["metric"] == "auroc"]
    assert set(scored["dataset"]) == {"tiny_graph"} and set(scored["inject_id"]) == {"none"}
    assert set(scored["group"]) == {"all", "anomaly"} and set(scored["variant"]) == {"mvfgad", "local_only"}
    assert not (run / "injection.parquet").exists()
    report = icml("fgad", "report", run, "--json")
    assert report.code == 0, report.err


@pytest.mark.parametrize("argv, message", [
    (["--set", "variants=mvfgad,nope"], "unknown variant(s) ['nope']"),
    (["--set", "signed_norm=other"], "signed_norm must be one of code, symmetric"),
    (["--set", "split=0.5,0.5"], "split must be three positive fractions"),
    (["--data", "/no/such/graph.mat"], "--data '/no/such/graph.mat' does not exist"),
])
def test_bad_input_is_one_line(icml, argv, message):
    result = icml("fgad", "train", "--preset", "smoke", *argv)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.err


def test_float_node_ids_in_an_edge_csv_are_refused_before_a_run_exists(icml, tmp_path):
    """pandas reads a src/dst column holding 2.5 as floats; the loader's int64 cast used to turn it into
    node 2 silently. Integral floats (2.0) stay accepted, as in the other loaders."""
    features = "node_id,f0,y\n" + "".join(f"{i},{i / 10},{int(i == 3)}\n" for i in range(6))
    (tmp_path / "features.csv").write_text(features)
    (tmp_path / "edges.csv").write_text("src,dst\n0,1\n1,2.5\n2,3\n")
    result = icml("fgad", "train", "--preset", "smoke", "--data", tmp_path / "edges.csv")
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "non-integer node id 2.5" in lines[0] and "column dst" in lines[0]
    assert "Traceback" not in result.err
    assert icml("runs", "--json").json()["runs"] == []  # refused before a run directory exists
    result = icml("fgad", "train", "--preset", "smoke", "--data", tmp_path)  # the folder form reads edges.csv
    assert result.code == 2 and "non-integer node id 2.5" in result.err
    from icml.methods.fgad.config import check_integer_node_ids

    (tmp_path / "edges.csv").write_text("src,dst\n0,1\n1,2.0\n2,3\n")
    check_integer_node_ids(tmp_path / "edges.csv")  # integral floats are node ids


def test_run_seeds_reach_every_random_choice(icml, tmp_path):
    """`--seeds 0,1` trains two different grids: the run seed shifts the grid seeds (0 → 123, 1 → 1123), so the
    graph, injection, partition and init differ. Before, both runs trained seed 123 and were identical.
    The same run seed again reproduces its run exactly."""
    argv = ["--preset", "smoke", "--set", "n_nodes=300", "--set", "rounds=2", "--set", "epochs=3", "--set", "K=3",
            "--set", "hidden=8", "--set", "out_dim=4", "--set", "variants=mvfgad,fedavg_dominant,partition_metis"]
    result = icml("fgad", "train", *argv, "--seeds", "0,1", "--json")
    assert result.code == 0, result.err
    runs = [Path(r["run_dir"]) for r in result.json()["runs"]]
    again = Path(icml("fgad", "train", *argv, "--seed", "1", "--json").json()["run_dir"])
    frames = []
    for run in runs + [again]:
        assert icml("fgad", "eval", run).code == 0
        frame = pq.read_table(run / "metrics.parquet").to_pandas()
        frame = frame[(frame["phase"] == "eval") & (frame["metric"] != "wall_s")]
        frames.append(frame.sort_values(["variant", "metric", "group", "agg"], kind="stable").reset_index(drop=True))
    assert set(frames[0]["seed"]) == {123} and set(frames[1]["seed"]) == {1123}
    assert set(frames[1]["variant"]) >= {"mvfgad", "fedavg_dominant", "partition_metis"}
    for variant in ("mvfgad", "fedavg_dominant", "partition_metis"):
        a, b = (f[f["variant"] == variant]["value"].to_numpy() for f in frames[:2])
        assert not np.allclose(a, b, equal_nan=True), variant
    injection = [pq.read_table(run / "injection.parquet").to_pandas() for run in runs]
    assert set(injection[0]["node_id"]) != set(injection[1]["node_id"])
    partition = [pq.read_table(run / "partition.parquet").to_pandas() for run in runs]
    assert not np.array_equal(partition[0]["client"], partition[1]["client"])
    np.testing.assert_array_equal(frames[2]["value"], frames[1]["value"])  # same run seed, same numbers
    assert icml("fgad", "train", *argv, "--seed", "-1").code == 2  # negative grid seeds: one line


def test_malformed_graph_file_is_one_line_before_a_run_exists(icml, tmp_path):
    """check_inputs loads the graph before the run: exit 2 and no run left behind (it used to be exit 1
    inside a new, failed run)."""
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((5, 2)), y=np.array([0, 1, 3, 0, 0]), edge_index=np.array([[0], [1]]))
    result = icml("fgad", "train", "--preset", "smoke", "--data", bad)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "must be 0/1 anomaly labels" in lines[0] and "Traceback" not in result.err
    assert icml("runs", "--json").json()["runs"] == []


def test_a_client_split_without_anomalies_keeps_the_last_epoch_with_nan_metrics(icml, tmp_path):
    """Two anomalies, K = 2: some client's validation split has none, so its AUROC is undefined in
    every epoch and round. Before: KeyError 'mvfgad' (stage 2) and DOMINANT's initial weights."""
    from icml.data.graphs import InjectionParams, synthetic_graph

    data, _ = synthetic_graph(160, 4, 9.0, 1.0, 8, 0.5, 0.5, InjectionParams(seed=0, fraction=0.03))
    y = np.zeros(data.num_nodes, dtype=np.int64)
    y[[3, 100]] = 1
    graph = tmp_path / "two_anomalies.npz"
    np.savez(graph, x=data.x.numpy(), y=y, edge_index=data.edge_index.numpy())
    result = icml("fgad", "train", "--preset", "smoke", "--data", graph, "--set", "K=2", "--set", "rounds=2",
                  "--set", "variants=mvfgad,local_only,fedavg_dominant", "--set", "epochs=3", "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    import torch

    for job, variant in (("mvfgad", "mvfgad"), ("local_only", "local_only"), ("dominant", "fedavg_dominant")):
        saved = torch.load(run / "checkpoints" / "jobs" / f"{job}_louvain_K2_s123.pt", weights_only=True)
        val = saved["val_auroc"][variant]  # per client: client 1 has no anomaly at all
        assert np.isnan(val[1]) and not np.isnan(val[0]), (variant, val)
        assert not torch.isnan(saved["scores"][variant]).any()
    assert icml("fgad", "eval", run).code == 0
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    scored = frame[(frame["metric"] == "auroc") & (frame["group"] == "all") & (frame["agg"] == "pooled")]
    assert set(scored["variant"]) >= {"mvfgad", "local_only", "fedavg_dominant"}
    assert scored["value"].notna().all()  # the kept last epoch/round scores every node


def test_one_run_judges_the_claims_over_its_grid_seeds():
    """A run trains seeds 123–125 itself: its report pairs each claim's arms within a grid seed (same graph
    and partition) and takes the t-interval over the seeds; rows at another K or group do not count."""
    import pandas as pd
    from scipy import stats

    from icml.methods.fgad.report import CLAIMS, _grid_claims
    from icml.reports.tables import fmt

    auroc = {"mvfgad": [0.80, 0.84, 0.83], "local_only": [0.78, 0.83, 0.80], "fedavg_dominant": [0.52, 0.50, 0.60]}
    rows = [{"phase": "eval", "metric": "auroc", "variant": variant, "K": K, "group": group, "agg": "client_weighted",
             "seed": seed, "value": value if (K, group) == (10, "all") else 0.0}
            for variant, values in auroc.items() for seed, value in zip([123, 124, 125], values)
            for K, group in [(10, "all"), (3, "all"), (10, "str_weak")]]
    frame = pd.DataFrame(rows)
    (table,) = _grid_claims(frame)
    local, dominant = table.frame.to_dict("records")
    for row, b in ((local, "local_only"), (dominant, "fedavg_dominant")):
        diffs = np.subtract(auroc["mvfgad"], auroc[b])
        half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / np.sqrt(3)
        assert row["per seed"] == " / ".join(fmt(d, 3) for d in diffs)
        assert row["a − b"] == fmt(diffs.mean(), 3)
        assert row["95 % interval"] == f"[{fmt(diffs.mean() - half, 3)}, {fmt(diffs.mean() + half, 3)}]"
    # mvfgad − local_only: 0.02 / 0.01 / 0.03, interval [−0.005, 0.045] crosses zero; − dominant lies above it
    assert (local["verdict"], dominant["verdict"]) == ("not shown", "holds")
    assert "seeds 123, 124, 125" in table.note and "grid seeds" in table.title
    # with one injection per grid seed (as in a run) the claim names carry no pooled inject_ids: they are
    # the same in every run, so a group report aligns them
    frame["inject_id"] = frame["seed"].map({123: "a", 124: "b", 125: "c"})
    (table,) = _grid_claims(frame)
    assert list(table.frame["claim"]) == [claim.name for claim in CLAIMS]
    assert _grid_claims(frame[frame["seed"] == 123]) == []  # one seed: nothing to judge


def test_the_ablation_table_follows_the_run_seed():
    """Run seed 1 trains its ablations at grid seed 1123: the ablation table finds them (it used to filter on
    the unshifted `ablation_seeds`, 123, and came out empty), under a title that is the same for every run
    seed so that a group report aligns the runs' tables."""
    import pandas as pd

    from icml.methods.fgad.config import FgadConfig
    from icml.methods.fgad.report import tables

    rows = [{"phase": "eval", "metric": "auroc", "variant": variant, "K": 10, "group": "all", "agg": agg,
             "seed": seed, "value": 0.7, "partition": "louvain"}
            for variant, seeds in (("mvfgad", (1123, 1124)), ("partition_random", (1123,)),
                                   ("partition_metis", (1123,)))
            for seed in seeds for agg in ("client_weighted", "pooled")]
    (ablation,) = [t for t in tables(pd.DataFrame(rows), FgadConfig()) if t.title.startswith("Ablations")]
    assert ablation.title == "Ablations — AUROC at K=10"
    assert set(ablation.frame["variant"]) == {"mvfgad", "partition_random", "partition_metis"}
    assert set(ablation.frame["seeds"]) == {1} and "grid seed(s) 1123" in ablation.note


def test_group_claims_pool_the_grid_seeds_injections():
    """In a group, each run's arm is its mean over its grid seeds, whose injections differ (three inject_ids):
    the claims pool inject_id on purpose instead of failing as a declaration error."""
    import pandas as pd

    from icml.methods.fgad import METHOD
    from icml.methods.fgad.report import CLAIMS
    from icml.reports.groups import judge_claims

    def run(run_seed, mvfgad, dominant):
        return pd.DataFrame([{"phase": "eval", "metric": "auroc", "variant": variant, "K": 10, "group": "all",
                              "agg": "client_weighted", "split": "test", "partition": "louvain", "dataset": "sbm",
                              "seed": 1000 * run_seed + grid, "inject_id": f"inj{run_seed}{grid}", "value": value}
                             for variant, values in (("mvfgad", mvfgad), ("local_only", dominant),
                                                     ("fedavg_dominant", dominant))
                             for grid, value in zip((123, 124, 125), values)])

    arms = [([0.8, 0.9, 0.7], [0.6, 0.7, 0.5]), ([0.85, 0.8, 0.75], [0.7, 0.6, 0.65]),
            ([0.9, 0.8, 0.85], [0.7, 0.75, 0.6])]
    frames = [run(seed, *values) for seed, values in enumerate(arms)]
    for claim in judge_claims(CLAIMS, frames, METHOD.metrics):
        assert not claim["verdict"].startswith("declaration error"), claim["verdict"]
        np.testing.assert_allclose(claim["per_seed"], [np.mean(a) - np.mean(b) for a, b in arms], rtol=1e-12)


def test_a_resumed_grid_records_what_an_uninterrupted_one_does(tmp_path, monkeypatch):
    """Ctrl-C after two finished jobs, then --resume: the finished jobs are not re-run, and the run's train rows
    equal an uninterrupted run's, row for row (wall-clock columns aside)."""
    import pandas as pd

    from conftest import interrupt_progress, invoke

    argv = ["fgad", "train", *TINY, "--set", "workers=1", "--runs-dir", tmp_path / "runs", "--json"]
    whole = invoke(*argv)
    assert whole.code == 0, whole.err
    restore = interrupt_progress(monkeypatch, lambda calls, jobs: jobs == 2)
    assert invoke(*argv).code == 130
    restore()
    interrupted = max((tmp_path / "runs" / "fgad").iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(list((interrupted / "checkpoints").rglob("*.pt"))) == 2
    resumed = invoke("fgad", "train", "--resume", interrupted, "--runs-dir", tmp_path / "runs")
    assert resumed.code == 0, resumed.err

    def train_rows(run) -> pd.DataFrame:
        frame = pd.read_parquet(Path(run) / "metrics.parquet")
        frame = frame[(frame["phase"] == "train") & (frame["metric"] != "wall_s")].drop(columns=["run_id"])
        keys = [c for c in frame.columns if c != "value"]
        return frame.sort_values(keys, na_position="first").reset_index(drop=True)

    pd.testing.assert_frame_equal(train_rows(interrupted), train_rows(whole.json()["run_dir"]), check_exact=True)
