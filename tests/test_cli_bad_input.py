"""Every bad input: one clear line on stderr naming problem and fix, exit 2 (usage) or 1
(runtime), no traceback, and nothing already on disk modified."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest


def one_error_line(result, *needles: str) -> None:
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1, result.err
    assert lines[0].startswith("icml: error: ") and " — " in lines[0], lines[0]
    assert "Traceback" not in result.err
    for needle in needles:
        assert needle in lines[0], lines[0]


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "report" not in p.parts}


@pytest.fixture
def trained(icml, toy, tmp_path):
    assert icml("toy", "train", "--preset", "smoke").code == 0
    assert icml("toy", "eval").code == 0
    return next((tmp_path / "runs" / "toy").iterdir())


@pytest.mark.parametrize("argv, code, needles", [
    (["nosuch", "train"], 2, ["No such command 'nosuch'", "icml list"]),
    (["toy", "train", "--preset", "huge"], 2, ["unknown preset 'huge'", "smoke, default, paper"]),
    (["toy", "train", "--set", "stepz=3"], 2, ["unknown config key 'stepz'", "did you mean 'steps'",
                                                "valid keys: steps, lr"]),
    (["toy", "train", "--set", "steps=many"], 2, ["bad value \"many\" for 'steps'", "expected an integer"]),
    (["toy", "train", "--set", "steps"], 2, ["malformed --set 'steps'", "key=value"]),
    (["toy", "train", "--set", "steps=0"], 2, ["steps must be positive"]),
    (["toy", "train", "--set", "lr=[1,2]"], 2, ["for 'lr'", "expected a number"]),
    (["toy", "train", "--device", "cuda"], 2, ["no CUDA device", "--device cpu"]),
    (["toy", "train", "--wat"], 2, ["No such option: --wat", "icml toy train --help"]),
    (["toy", "train", "--model", "."], 2, ["No such option: --model", "icml toy train --help"]),
    (["toy", "train", "--data", "no/such.txt"], 2, ["--data 'no/such.txt' does not exist"]),
    (["toy", "eval"], 2, ["no run of toy with a completed train", "icml toy train"]),
    (["toy", "eval", "does/not/exist"], 2, ["does not exist", "icml runs"]),
    (["report"], 2, ["report needs run directories"]),
    (["report", "--method", "nosuch"], 2, ["unknown method 'nosuch'"]),
    (["toy", "report", "--format", "pdf"], 2, ["unknown report format 'pdf'", "markdown"]),
])
def test_usage_errors(icml, toy, argv, code, needles):
    if "cuda" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present here")
    result = icml(*argv)
    assert result.code == code
    one_error_line(result, *needles)


def test_config_file_errors(icml, toy, tmp_path):
    missing = icml("toy", "train", "--config", tmp_path / "none.json")
    assert missing.code == 2
    one_error_line(missing, "does not exist")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = icml("toy", "train", "--config", broken)
    assert result.code == 2
    one_error_line(result, "not valid JSON (line 1")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"steps": 3, "nope": 1}))
    result = icml("toy", "train", "--config", unknown)
    assert result.code == 2
    one_error_line(result, "unknown config key 'nope'")
    assert not (tmp_path / "runs").exists()  # no run directory was created for bad input


def test_corrupt_run_json_and_parquet_leave_files_alone(icml, trained, tmp_path):
    before = digest(trained)
    (trained / "metrics.parquet").write_bytes(b"PAR1 this is not parquet")
    corrupted = digest(trained)
    result = icml("toy", "report", trained)
    assert result.code == 1
    one_error_line(result, "is corrupt", "re-run")
    result = icml("toy", "eval", trained)  # eval must not overwrite what it cannot read
    assert result.code == 1
    one_error_line(result, "is corrupt")
    assert digest(trained) == corrupted  # refused before starting: run.json untouched too

    (trained / "run.json").write_text("{")
    result = icml("toy", "report", trained)
    assert result.code == 2
    one_error_line(result, "run.json", "is corrupt")
    assert before.keys() == digest(trained).keys()


def test_resume_rejects_overrides(icml, trained):
    result = icml("toy", "train", "--resume", trained, "--set", "steps=3")
    assert result.code == 2
    one_error_line(result, "--resume continues a run with its own config")


def test_wrong_method_run_dir(icml, trained):
    result = icml("belief-filter", "eval", trained)
    assert result.code == 2
    one_error_line(result, "is a run of toy, not belief-filter")


def test_debug_raises_instead_of_one_line(icml, trained):
    from icml.cli.errors import IcmlError
    from icml.cli.main import main

    (trained / "metrics.parquet").write_bytes(b"garbage")
    with pytest.raises(IcmlError, match="is corrupt"):
        main(["toy", "report", str(trained), "--debug"])


@pytest.mark.parametrize("argv, problem", [
    (["toy", "train", "--preset", "nope"], "unknown preset 'nope'"),  # our validation
    (["toy", "train", "--bogus"], "No such option: --bogus"),  # click's, before any command runs
    (["toy", "eval", "/nonexistent/run"], "/nonexistent/run"),
])
def test_json_errors_are_one_json_object_on_stdout(icml, toy, argv, problem):
    """`RD=$(icml … --json | jq -r .run_dir)` must fail on a clear object, not read an empty stdout."""
    result = icml(*argv, "--json")
    one_error_line(result, problem)
    doc = result.json()
    assert doc["status"] == "error" and problem in doc["error"] and doc["fix"] and doc["exit_code"] == result.code == 2


def test_listings_are_data_on_stdout_with_whole_ids(icml, toy, tmp_path):
    """`icml runs | grep …` and `icml list | grep …` see every row, whole (no terminal: plain columns)."""
    assert icml("toy", "train", "--preset", "smoke", "--seeds", "0,1").code == 0
    result = icml("runs")
    runs = sorted((tmp_path / "runs" / "toy").iterdir())
    lines = result.out.splitlines()
    assert result.code == 0 and lines[0].split() == ["run", "method", "preset", "seed", "train", "eval", "started",
                                                     "run", "dir"]
    for run in runs:
        (line,) = [line for line in lines if run.name in line]
        assert line.split()[0] == run.name and line.split()[-1] == str(run)  # the id and the run dir, uncut
    listing = icml("list").out
    from icml.cli.registry import METHODS

    assert all(any(line.split()[0] == name for line in listing.splitlines()) for name in METHODS)


def test_each_method_help_is_its_own():
    """train --help lists the method's keys with defaults and meanings (from its config dataclasses), what
    --data / --model accept, or neither option where the method takes none; `config` prints the resolved
    config; a malformed --set is answered with one of the method's own keys."""
    from conftest import invoke

    fgad = " ".join(invoke("fgad", "train", "--help").out.split())  # rich wraps lines at the terminal's width
    assert "tau = 0.9" in fgad and "cosine threshold of U" in fgad and "--data" in fgad and "--model" not in fgad
    assert "a folder with edges.csv+features.csv" in fgad and "README" in fgad
    belief = " ".join(invoke("belief-filter", "train", "--help").out.split())
    assert "takes no --data or --model" in belief and "hmm.path = none" in belief and "--data <path>" not in belief
    refused = invoke("belief-filter", "train", "--data", "x.json")
    assert refused.code == 2 and "No such option: --data" in refused.err

    shown = invoke("fgad", "config", "--preset", "smoke", "--set", "K=10")
    doc = shown.json()
    assert shown.code == 0 and doc["preset"] == "smoke" and doc["config"]["K"] == [10]

    malformed = invoke("belief-filter", "train", "--set", "oops")
    assert malformed.code == 2 and "e.g. --set " in malformed.err and "seeds=3" not in malformed.err


def test_bad_data_content_is_refused_before_a_run_exists(icml, tmp_path):
    """The lifecycle asks the method to look at its inputs' content (Method.check_inputs) before it creates
    the run: event-classify's loader reads one recording per class, so a folder of non-event files is one
    line and exit 2, with no failed run left behind (it used to fail at exit 1 inside a new run)."""
    folder = tmp_path / "events"
    for cls in ("0", "1"):
        (folder / cls).mkdir(parents=True)
        (folder / cls / "a.bin").write_bytes(bytes(range(256)) * 4)
    result = icml("event-classify", "train", "--preset", "smoke", "--data", folder)
    one_error_line(result, "a.bin", "not an N-MNIST/N-Caltech101 .bin file")
    assert result.code == 2 and not (tmp_path / "runs").exists()


def _garbage(tmp_path):
    """Bytes that are no format at all, as a file with the extension most methods read, and as a folder
    whose every file is such bytes (a class folder, a captions.csv, an edges.csv)."""
    junk = bytes(range(256))[::-1] * 16
    (tmp_path / "junk.csv").write_bytes(junk)
    for name in ("a/x.png", "b/y.png", "captions.csv", "edges.csv", "core/t.txt", "0/e.bin", "1/f.bin"):
        (tmp_path / "junkdir" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "junkdir" / name).write_bytes(junk)
    return tmp_path / "junk.csv", tmp_path / "junkdir"


def _takes_data():
    from icml.cli import registry
    from icml.cli.method_app import inputs_of

    return [name for name in registry.METHODS if "data" in inputs_of(registry.get(name))]


@pytest.mark.parametrize("name", _takes_data())
def test_garbage_data_is_one_line_and_exit_2_before_any_run(icml, tmp_path, name):
    """Every method that takes --data reads its content before the run exists: a file or a folder of
    garbage is one line, exit 2, and no run directory (it used to leave failed runs, at exit 1 or 2)."""
    for data in _garbage(tmp_path):
        result = icml(name, "train", "--preset", "smoke", "--data", data)
        one_error_line(result)
        assert result.code == 2 and not (tmp_path / "runs").exists(), (data.name, result.err)


def _takes_model():
    from icml.cli import registry
    from icml.cli.method_app import inputs_of

    return [name for name in registry.METHODS if "model" in inputs_of(registry.get(name))]


def _bad_checkpoints(tmp_path):
    """An empty folder, a checkpoint of a family no method takes (BERT) with its tokenizer, and a Llama
    checkpoint whose weights file is cut short."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    (tmp_path / "empty").mkdir()
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    words.save_pretrained(tmp_path / "bert")
    LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32)).save_pretrained(tmp_path / "cut")
    words.save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return tmp_path / "empty", tmp_path / "bert", tmp_path / "cut"


@pytest.mark.parametrize("name", _takes_model())
def test_a_bad_model_is_one_line_and_exit_2_before_any_run(icml, tmp_path, name):
    """Every method that takes --model reads the checkpoint's headers before the run exists: an empty
    folder, a family the method does not drive, and truncated weights are one line, exit 2, no run."""
    for model in _bad_checkpoints(tmp_path):
        result = icml(name, "train", "--preset", "smoke", "--model", model)
        one_error_line(result)
        assert result.code == 2 and not (tmp_path / "runs").exists(), (model.name, result.err)
