"""`icml kv-compress count-probe` (methods/kv_compress/probe.py) on a tiny trained run: the occurrences
are the asked pairs' value tokens and give the answer; the attention shares equal the model's own
eager attention; the cue step is the eval's decoding step with the full cache; SnapKV and full score
as eval scores them; at r = 1 everything is kept and every selection scores as full; the question-row
scores are the two rows' SnapKV vote; the blind floor equals enumeration; the CLI writes the table
its summary is the mean of, and bad input is one line."""
from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import invoke

TINY = ["--preset", "smoke", "--set", "steps=4", "--set", "val_every=4", "--set", "val_per_task=2",
        "--set", "n_per_task=3", "--set", "tiny.hidden=32", "--set", "tiny.intermediate=64",
        "--set", "context_min=60", "--set", "context_max=80", "--set", "train_context_min=60",
        "--set", "calibrate_on_train=false"]
COLUMNS = ["run_id", "example_id", "seed", "ratio", "variant", "layer", "kv_head", "row", "metric", "value"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(runs dir, run dir, cfg, model, tokenizer, counting prompts) of a 4-step tiny run."""
    from icml.cli.lifecycle import config_from_run
    from icml.cli.runstore import Run
    from icml.methods.kv_compress import METHOD
    from icml.methods.kv_compress.pipeline import load_model
    from icml.methods.kv_compress.probe import counting_prompts

    runs = tmp_path_factory.mktemp("runs")
    result = invoke("kv-compress", "train", *TINY, "--runs-dir", runs, "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    cfg, _, seed = config_from_run(METHOD, Run(run))
    model, tokenizer = load_model(run, cfg, None, "cpu")
    return runs, run, cfg, model, tokenizer, counting_prompts(cfg, seed, None)


def test_occurrences_are_the_asked_pairs_and_give_the_answer(trained):
    from icml.methods.kv_compress.probe import locate

    _, _, cfg, _, tokenizer, examples = trained
    assert len(examples) == 3 and {e.task for e in examples} == {"aggregation"}
    for example in examples:
        prompt = locate(tokenizer, example, cfg.window, "cpu")
        words = example.context.split()
        triples = [words[i:i + 3] for i in range(len(words) - 2)]
        pairs = sum(t[0].startswith("k") and t[1] == prompt.value and t[2] == ";" for t in triples)
        assert len(prompt.occurrences) + prompt.window_occurrences == pairs
        assert str(pairs % 10) == example.answer
        value_id = tokenizer.convert_tokens_to_ids(prompt.value)
        assert bool((prompt.parts.prefix[prompt.occurrences] == value_id).all())
        assert prompt.history == prompt.n - cfg.window and bool((prompt.occurrences < prompt.history).all())
        assert tokenizer.decode(prompt.parts.prefix[-2:]) == f"{prompt.value} ?"
        assert tokenizer.decode(prompt.parts.tail[:1]) == "="


def test_attention_shares_equal_eager_attention(trained):
    """Each share = the eager attention of that row on the occurrences over its attention on the
    history, per query head, averaged over heads; the cue row is the full-cache decoding step."""
    from icml.methods.kv_compress.model import RaggedCache, extend, prefill
    from icml.methods.kv_compress.probe import cue_step, locate, probe_prompt

    _, _, cfg, model, tokenizer, examples = trained
    example = next(e for e in examples if len(locate(tokenizer, e, cfg.window, "cpu").occurrences) > 0)
    probe = probe_prompt(model, tokenizer, example, cfg, 0.3, "cpu")
    prompt = probe.prompt
    ids = torch.cat([prompt.parts.prefix, prompt.parts.tail[:1]])
    with torch.no_grad():
        eager = model(ids[None], output_attentions=True).attentions
    positions = {"?": prompt.n - 1, "v": prompt.n - 2, "=": prompt.n}
    for row, position in positions.items():
        for layer, attention in enumerate(eager):
            rows = attention[0, :, position].double()  # [Hq, keys]
            expected = (rows[:, prompt.occurrences].sum(-1) / rows[:, :prompt.history].sum(-1)).mean()
            assert 0 <= probe.attention[row][layer] <= 1
            assert probe.attention[row][layer] == pytest.approx(float(expected), abs=1e-6)
    state = prefill(model, prompt.parts.prefix, cfg.window)
    everything = [[torch.arange(state.n)] * state.shape[1]] * state.shape[0]
    decoded, _ = extend(model, RaggedCache.from_prefill(state, everything), prompt.parts.tail[:1])
    step = prefill(model, ids, 1, with_logits=True)
    assert torch.allclose(step.logits[-1], decoded[-1], atol=1e-5)
    assert torch.equal(cue_step(model, prompt).window_queries[0], step.window_queries[0])


def test_snapkv_and_full_score_as_eval_scores_them(trained):
    from icml.methods.kv_compress.evaluation import evaluate_example, variant_spec
    from icml.methods.kv_compress.probe import probe_prompt

    _, _, cfg, model, tokenizer, examples = trained
    specs = [variant_spec("full", cfg), variant_spec("snapkv", cfg)]
    for example in examples:
        probe = probe_prompt(model, tokenizer, example, cfg, 0.3, "cpu")
        rows, allocations = evaluate_example(model, tokenizer, example, cfg, specs, [0.3], None, "cpu")
        for row in rows:
            assert probe.exact_match[row["variant"]] == row["exact_match"]
        snapkv_budget = {a["budget"] for a in allocations if a["variant"] == "snapkv"}
        assert snapkv_budget == {probe.budget}
        kept = probe.selections["snapkv"].kept
        for layer, heads in enumerate(kept):
            for head, positions in enumerate(heads):
                history = positions[positions < probe.prompt.history].numpy()
                if len(probe.prompt.occurrences):
                    share = np.isin(probe.prompt.occurrences.numpy(), history).mean()
                    assert probe.kept_share["snapkv"][layer, head] == share
                assert len(history) == probe.budget


def test_ratio_one_keeps_every_occurrence_and_scores_as_full(trained):
    from icml.methods.kv_compress.probe import probe_prompt

    _, _, cfg, model, tokenizer, examples = trained
    for example in examples:
        probe = probe_prompt(model, tokenizer, example, cfg, 1.0, "cpu")
        assert probe.budget == probe.prompt.history and probe.floor == 1.0
        for shares in probe.kept_share.values():
            assert np.all(shares == 1.0) if len(probe.prompt.occurrences) else np.all(np.isnan(shares))
        assert probe.exact_match["snapkv_question_rows"] == probe.exact_match["snapkv"] == probe.exact_match["full"]


def test_question_row_scores_are_the_two_rows_vote(trained):
    """Zeroing the other window rows turns SnapKV's window mean into (2/w)·the mean of `v` and `?`."""
    import torch.nn.functional as F

    from icml.methods.kv_compress import compress as kv
    from icml.methods.kv_compress.evaluation import analyse
    from icml.methods.kv_compress.model import prefill
    from icml.methods.kv_compress.probe import locate, question_row_analysis

    _, _, cfg, model, tokenizer, examples = trained
    prompt = locate(tokenizer, examples[0], cfg.window, "cpu")
    state = prefill(model, prompt.parts.prefix, cfg.window)
    analysis = analyse(state, cfg)
    masked = question_row_analysis(analysis)
    _, n_kv, n_q = state.shape
    for attention, rows_only in zip(analysis.attentions, masked.attentions):
        two_rows = attention[:, -2:, :prompt.history].mean(1)  # [Hq, history]
        vote = two_rows.reshape(n_kv, n_q // n_kv, -1).mean(1)[:, None]
        expected = F.max_pool1d(vote, cfg.kernel, stride=1, padding=cfg.kernel // 2)[:, 0]
        scores = kv.snapkv_scores(rows_only, n_kv, cfg.kernel, cfg.pool)
        assert cfg.pool == "max" and torch.allclose(scores * cfg.window / 2, expected, rtol=1e-6, atol=0)
        assert not torch.allclose(scores * cfg.window / 2, kv.snapkv_scores(attention, n_kv, cfg.kernel, cfg.pool))


@pytest.mark.parametrize("history,budget,occurrences", [(8, 3, 0), (8, 3, 1), (8, 3, 2), (8, 3, 3), (8, 3, 4),
                                                        (9, 5, 2), (7, 7, 3), (10, 4, 3), (12, 6, 4)])
def test_blind_floor_equals_enumeration(history, budget, occurrences):
    from icml.methods.kv_compress.probe import blind_floor

    keeps = list(itertools.combinations(range(history), budget))
    wanted = set(range(occurrences))
    enumerated = sum(wanted <= set(keep) for keep in keeps) / len(keeps)
    assert blind_floor(history, budget, occurrences) == pytest.approx(enumerated, rel=1e-15, abs=0)


def test_cli_writes_the_table_its_summary_averages(trained, icml):
    runs, run, cfg, *_ = trained
    result = icml("kv-compress", "count-probe", "--n", "3", "--runs-dir", runs, "--json")  # the latest train run
    assert result.code == 0, result.err
    out = result.json()
    assert out["run_dir"] == str(run) and out["prompts"] == 3 and out["ratio"] == 0.3
    assert out["prompts_with_occurrence"] >= 1
    frame = pq.read_table(run / "count_probe.parquet").to_pandas()
    assert list(frame.columns) == COLUMNS
    L, n_kv = cfg.tiny.layers, cfg.tiny.kv_heads
    assert len(frame) == 3 * (5 + 3 + 3 * L + 2 * (1 + 2 * L * n_kv))
    assert set(frame["run_id"]) == {run.name} and set(frame["seed"]) == {0} and set(frame["example_id"]) == {0, 1, 2}
    attention = frame[frame["metric"] == "occurrence_attention"]
    assert set(attention["row"]) == {"?", "v", "="} and attention["value"].between(0, 1).all()
    occurrences = frame[frame["metric"] == "n_occurrences"].set_index("example_id")["value"]
    found = attention[attention["example_id"].isin(occurrences.index[occurrences > 0])]
    for row in ("?", "v", "="):
        per_layer = found[found["row"] == row].groupby("layer")["value"].mean().reindex(range(L))
        assert np.allclose(out["occurrence_attention"][row]["per_layer"], per_layer.to_numpy(), rtol=1e-12)
    em = frame[frame["metric"] == "exact_match"]
    assert set(em["value"]) <= {0.0, 1.0}
    for variant in ("full", "snapkv", "snapkv_question_rows"):
        assert out["exact_match"][variant] == pytest.approx(em.loc[em["variant"] == variant, "value"].mean())
    assert 0 <= out["blind_floor"] <= 1 and 0 <= out["snapkv"]["all_kept"] <= 1
    human = icml("kv-compress", "count-probe", run, "--n", "1", "--ratio", "0.5")
    assert human.code == 0 and human.out == ""
    assert "snapkv_question_rows" in human.err and "blind floor" in human.err and "count_probe.parquet" in human.err
    assert set(pq.read_table(run / "count_probe.parquet").to_pandas()["ratio"]) == {0.5}  # rewritten


def test_bad_input_is_one_line(trained, icml, tmp_path):
    runs, run, *_ = trained
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("run.json", "config.json"):
        shutil.copy(run / name, bare / name)
    cases = [(["--ratio", "0"], "--ratio must be a budget fraction in (0, 1]"),
             (["--ratio", "1.5"], "not 1.5"),
             (["--n", "0"], "--n must be positive"),
             ([bare], "has no trained model checkpoint"),
             (["--runs-dir", tmp_path / "empty"], "no run of kv-compress with a completed train")]
    for argv, message in cases:
        result = icml("kv-compress", "count-probe", *(argv if "--runs-dir" in argv else [*argv, "--runs-dir", runs]))
        lines = result.err.strip().splitlines()
        assert result.code == 2, (argv, result.err)
        assert len(lines) == 1 and lines[0].startswith("icml: error: ") and message in lines[0], (argv, result.err)
    assert not (bare / "count_probe.parquet").exists()


def test_help_imports_no_torch():
    code = ("import sys\nfrom icml.cli.main import main\n"
            "try:\n    main(['kv-compress', 'count-probe', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules and 'pandas' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--ratio" in result.stdout and "count_probe.parquet" in result.stdout
