"""The lifecycle through the CLI, on the toy method: train → eval → report, --json, runs,
determinism, --config reproduction, Ctrl-C and --resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from conftest import TESTS


def only_run(root: Path, method: str = "toy") -> Path:
    runs = sorted((root / method).iterdir())
    assert len(runs) == 1
    return runs[0]


def test_train_eval_report_json(icml, toy, tmp_path):
    result = icml("toy", "train", "--preset", "smoke", "--seed", "3", "--json")
    assert result.code == 0, result.err
    doc = result.json()
    run = Path(doc["run_dir"])
    assert doc["status"] == "completed" and doc["phase"] == "train" and doc["method"] == "toy"
    assert set(doc["metrics"]["loss"]) == {"sgd", "momentum"}
    info = json.loads((run / "run.json").read_text())
    for key in ("run_id", "method", "argv", "preset", "seed", "device", "status", "started", "versions",
                "git_commit"):
        assert key in info
    assert info["preset"] == "smoke" and info["seed"] == 3 and info["device"] == "cpu"
    for package in ("python", "torch", "transformers", "diffusers", "torch_geometric"):
        assert package in info["versions"]
    assert json.loads((run / "config.json").read_text())["config"]["steps"] == 20
    assert (run / "checkpoints" / "sgd.pt").exists()

    result = icml("toy", "eval", "--json")  # defaults to the latest trained run
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["run_dir"] == str(run) and doc["phase"] == "eval" and doc["status"] == "completed"
    assert set(doc["metrics"]["mse"]) == {"sgd", "momentum"}

    predictions = pq.read_table(run / "predictions.parquet").to_pandas()
    assert len(predictions) == 2 * 64 and set(predictions["variant"]) == {"sgd", "momentum"}
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    assert list(frame.columns[:9]) == ["run_id", "method", "phase", "step", "split", "variant", "metric",
                                       "value", "seed"]
    assert set(frame["phase"]) == {"train", "eval"}
    assert (frame.loc[frame.phase == "train", "split"] == "train").all()
    assert frame["lr"].notna().all() and (frame["seed"] == 3).all()

    result = icml("toy", "report")  # terminal: human output on stderr, nothing on stdout
    assert result.code == 0 and result.out == ""
    assert "mse" in result.err and "smoke" in result.err
    for name in ("report.md", "report.html", "toy_loss_curve.png", "toy_predictions.png"):  # the 2nd reads
        # predictions.parquet through the run handed to a hook that declares `run`
        assert (run / "report" / name).exists()


def test_data_option_sets_the_data_key(icml, toy, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    with_data = icml("toy", "train", "--preset", "smoke", "--data", corpus, "--json").json()
    recorded = json.loads((Path(with_data["run_dir"]) / "config.json").read_text())["config"]["data"]
    assert recorded == str(corpus.resolve())


def test_report_formats(icml, toy, tmp_path):
    assert icml("toy", "train", "--preset", "smoke").code == 0
    assert icml("toy", "eval").code == 0
    run = only_run(tmp_path / "runs")

    md = icml("toy", "report", "--format", "markdown").out
    assert "| variant | mse ↓ |" in md and "smoke preset" in md

    html_out = tmp_path / "r.html"
    assert icml("report", "--all", "--format", "html", "--out", html_out).code == 0
    html = html_out.read_text()
    assert "src='data:image/png;base64," in html and "mse ↓" in html
    assert "http://" not in html and "https://" not in html  # self-contained

    csv = icml("report", str(run), "--format", "csv").out
    assert set(pd.read_csv(__import__("io").StringIO(csv))["metric"]) == {"loss", "mse"}

    doc = json.loads(icml("report", "--method", "toy", "--format", "json").out)
    (entry,) = doc["runs"]
    assert entry["smoke"] is True and entry["headline"]["mse"].keys() == {"sgd", "momentum"}
    titles = [t["title"] for t in entry["tables"]]
    assert "eval metrics" in titles
    assert icml("report", "--method", "toy", "--json").json()["runs"][0]["run_id"] == run.name


def test_runs_listing(icml, toy, tmp_path):
    assert icml("toy", "train", "--preset", "smoke").code == 0
    doc = icml("runs", "--json").json()
    (row,) = doc["runs"]
    assert row["method"] == "toy" and row["phases"] == {"train": "completed"}
    assert icml("runs", "--method", "toy", "--json").json()["runs"] == doc["runs"]
    assert icml("runs", "--method", "nope").code == 2


def test_same_seed_same_metrics_and_config_reproduces(icml, toy, tmp_path):
    runs = []
    for argv in (["--seed", "5"], ["--seed", "5"], ["--seed", "6"]):
        result = icml("toy", "train", "--preset", "smoke", "--set", "lr=0.01", *argv, "--json")
        runs.append(Path(result.json()["run_dir"]))
    reproduced = icml("toy", "train", "--config", runs[0] / "config.json", "--json")
    runs.append(Path(reproduced.json()["run_dir"]))

    def values(run):
        return pq.read_table(run / "metrics.parquet").to_pandas()["value"].tolist()

    assert values(runs[0]) == values(runs[1]) == values(runs[3])
    assert values(runs[0]) != values(runs[2])
    info = json.loads((runs[3] / "run.json").read_text())
    assert info["preset"] == "smoke" and info["seed"] == 5


def _launch(argv, runs_dir):
    # A shell without job control starts background jobs (`make test &`) with SIGINT ignored, and the
    # child would inherit that; a Ctrl-C at a terminal reaches a process with Python's default handler.
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.path.insert(0, sys.argv[1]); from icml.cli import registry; "
            "registry.METHODS['toy'] = 'toy_method'; from icml.cli.main import main; sys.exit(main(sys.argv[2:]))")
    return subprocess.Popen([sys.executable, "-c", code, str(TESTS), *argv],
                            env={**os.environ, "ICML_RUNS_DIR": str(runs_dir)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ctrl_c_marks_interrupted_and_resume_matches_uninterrupted(tmp_path):
    runs_dir = tmp_path / "runs"
    slow = ["toy", "train", "--preset", "smoke", "--set", "sleep=0.05", "--set", "variants=sgd",
            "--set", "steps=60"]
    proc = _launch(slow, runs_dir)
    deadline = time.time() + 60
    while time.time() < deadline and not list(runs_dir.glob("toy/*/checkpoints/sgd.pt")):
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    run = only_run(runs_dir)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "interrupted" and info["phases"]["train"]["status"] == "interrupted"
    partial = pq.read_table(run / "metrics.parquet").to_pandas()
    assert 0 < len(partial) < 60

    resumed = _launch(["toy", "train", "--resume", str(run)], runs_dir)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    kept = len(partial)  # the header says where it continues
    assert f"resume: continues from the run's checkpoints after train step {kept} ({kept} train rows kept)" in err
    assert json.loads((run / "run.json").read_text())["status"] == "completed"
    assert json.loads((run / "run.json").read_text())["phases"]["train"]["resumed"] is True

    fresh = _launch(slow[:5] + ["sleep=0", *slow[6:], "--runs-dir", str(tmp_path / "fresh")], runs_dir)
    fresh.communicate(timeout=120)
    assert fresh.returncode == 0
    reference = pq.read_table(only_run(tmp_path / "fresh") / "metrics.parquet").to_pandas()
    finished = pq.read_table(run / "metrics.parquet").to_pandas()
    assert finished["step"].tolist() == list(range(1, 61))
    assert finished["value"].tolist() == reference["value"].tolist()


def test_progress_bars_only_on_a_terminal_and_never_when_quiet(monkeypatch):
    import io

    from rich.console import Console

    from icml.cli import console

    for is_terminal, quiet, expect_bar in ((True, False, True), (False, False, False), (True, True, False)):
        buffer = io.StringIO()
        monkeypatch.setattr(console, "err", Console(file=buffer, force_terminal=is_terminal, width=80))
        console.set_quiet(quiet)
        with console.progress("looping", total=3) as advance:
            for _ in range(3):
                advance(1)
        assert ("looping" in buffer.getvalue()) == expect_bar
    console.set_quiet(False)


def test_results_are_written_with_the_umask_mode_not_0600(tmp_path):
    """Atomic writes go through mkstemp, which makes 0600 files: on a shared --runs-dir nobody else
    could read a colleague's metrics.parquet, run.json or report. A fresh process (the umask is read
    once per process) under umask 022 must give 0644 files, and under 077 keep them private."""
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        runs, out = tmp_path / f"runs{umask:o}", tmp_path / f"report{umask:o}.html"
        script = (f"import os, sys; os.umask({umask}); sys.path.insert(0, {str(TESTS)!r}); "
                  "from icml.cli import registry; registry.METHODS['toy'] = 'toy_method'; "
                  "from icml.cli.main import main; "
                  f"assert main(['toy', 'train', '--preset', 'smoke', '--runs-dir', {str(runs)!r}]) == 0; "
                  f"assert main(['toy', 'eval', '--runs-dir', {str(runs)!r}]) == 0; "
                  f"assert main(['report', '--all', '--runs-dir', {str(runs)!r}, '--format', 'html', "
                  f"'--out', {str(out)!r}]) == 0")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        run = only_run(runs)
        written = [run / "run.json", run / "config.json", run / "metrics.parquet", out]
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(mode) for p in written}


def test_html_report_has_contents_anchors_and_scrolling_tables(icml, toy, tmp_path):
    """A combined report of several runs: a contents list naming each run with links to its section,
    tables and plots; ids unique and every link landing on one; every data table inside a horizontally
    scrolling box, so a wide table never runs off the page."""
    from html.parser import HTMLParser

    assert icml("toy", "train", "--preset", "smoke", "--seeds", "0,1").code == 0
    assert icml("toy", "eval", "--seeds", "0,1").code == 0
    out = tmp_path / "all.html"
    assert icml("report", "--all", "--format", "html", "--out", out).code == 0

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.links, self.stack, self.tables = [], [], [], []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if "id" in attrs:
                self.ids.append(attrs["id"])
            if tag == "a" and attrs.get("href", "").startswith("#"):
                self.links.append(attrs["href"][1:])
            if tag == "table":
                self.tables.append((attrs.get("class"), [dict(a).get("class") for _, a in self.stack]))
            self.stack.append((tag, attrs))

        def handle_endtag(self, tag):
            while self.stack and self.stack.pop()[0] != tag:
                pass

    page = Page()
    page.feed(out.read_text())
    assert len(page.ids) == len(set(page.ids)) and set(page.links) <= set(page.ids)
    runs = sorted((tmp_path / "runs" / "toy").iterdir())
    nav = out.read_text().split("<nav>")[1].split("</nav>")[0]
    assert all(run.name in nav for run in runs) and nav.count("<li>") == len(runs)
    data_tables = [parents for cls, parents in page.tables if cls != "facts"]
    assert data_tables and all("scroll" in parents for parents in data_tables)
    assert sum(link != "top" for link in page.links) >= 2 * (len(runs) + 2)  # contents + in-section links
