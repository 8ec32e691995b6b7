"""`--preset real` of kv-compress without SmolLM2: the natural-text chat tasks (deterministic per seed, needles at
their stated depths, the answer in the context, the tokenizer's own chat format, scoring), the one-prefill /
many-arms path through `generate()` against each arm's own prefill and against plain `generate()`, and
`--preset real` end to end through the CLI on a tiny random Llama with a chat template (train = calibration,
eval stopped by SIGTERM and continued, report)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from conftest import interrupt_progress, invoke
from icml.methods.kv_compress import real_tasks as rt
from icml.methods.kv_compress.config import REAL_VARIANTS, preset, validate
from icml.methods.kv_compress.real import first_sentence, item_recall, scores

# SmolLM2's chat template (ChatML with a default system turn)
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
            "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer():
    """A character-level tokenizer (printable ASCII and newline) with ChatML's special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + ["\n"] + [chr(c) for c in range(32, 127)])}
    characters = Tokenizer(BPE(vocab=vocab, merges=[]))
    characters.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters,
                                        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIALS)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def tiny_chat_llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0))
    with torch.no_grad():  # sharper attention than at init, so that entropies and budgets differ between heads
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


LENGTHS = {"passkey": 3000, "passkey_long": 4000, "multikey": 2000, "aggregation": 2000}  # characters here


def make(tokenizer, seed=0, stream="test", n=5, tasks=rt.REAL_TASKS):
    return rt.real_set(list(tasks), n, seed, stream, rt.token_counter(tokenizer), LENGTHS)


# ---------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------
def test_the_set_is_deterministic_per_seed_and_stream_and_each_task_has_its_own_draws(tokenizer):
    first, again = make(tokenizer), make(tokenizer)
    assert first == again
    assert make(tokenizer, seed=1) != first and make(tokenizer, stream="calibration") != first
    alone = make(tokenizer, tasks=["multikey"])
    assert alone == [e for e in first if e.task == "multikey"]  # the other tasks change no task's examples
    assert [e.task for e in first] == [t for t in rt.REAL_TASKS for _ in range(5)]


def test_needles_sit_at_their_stated_depths_and_the_answer_is_in_the_context(tokenizer):
    count = rt.token_counter(tokenizer)

    def fillers(text: str, needles) -> int:  # filler sentences end with their only full stop
        for needle in needles:
            text = text.replace(needle, "")
        return text.count(".")

    for example in make(tokenizer, n=10):
        assert len(example.needles) == len(example.depths) and example.asked
        positions = [example.context.index(needle) for needle in example.needles]
        assert positions == sorted(positions)  # needles and depths in the order of the text
        total = fillers(example.context, example.needles)
        for needle, depth in zip(example.needles, example.depths):
            before = example.context[:example.context.index(needle)]
            assert fillers(before, example.needles) / total == pytest.approx(depth, abs=1e-12)
        for item in example.items:  # what the answer needs is in an asked needle, and in no other needle
            holders = [i for i, needle in enumerate(example.needles) if item in needle]
            assert len(holders) == 1 and holders[0] in example.asked
            assert example.context.count(item) == (2 if example.task.startswith("passkey") else 1)
        digits = lambda text: "".join(c for c in text if c.isdigit())  # noqa: E731
        assert digits(example.context) == "".join(map(digits, example.needles))  # no digit in the filler
        assert -2 <= count(example.context) - LENGTHS[example.task] < 100  # one sentence past the budget at most
        assert example.user_message().endswith(example.question) and example.context in example.user_message()
    passkeys = [e for e in make(tokenizer, n=10) if e.task == "passkey"]
    assert [e.depths[0] for e in passkeys] == pytest.approx([rt.DEPTHS[i % 5] for i in range(10)], abs=0.02)
    multikey = [e for e in make(tokenizer, n=8) if e.task == "multikey"]
    assert [e.asked for e in multikey] == [(i % 4,) for i in range(8)]  # the first, second, … needle in turn
    assert all(f"for {e.question.split(' for ')[1].split('?')[0]} is {e.answer}." in e.needles[e.asked[0]]
               for e in multikey)  # the asked city's number
    aggregation = next(e for e in make(tokenizer) if e.task == "aggregation")
    assert set(aggregation.items) == {needle.split()[-1].rstrip(".") for needle in aggregation.needles}
    assert aggregation.asked == (0, 1, 2) and "three special magic numbers" in aggregation.question


def test_the_prompt_is_the_tokenizers_chat_format_then_the_answer_prefix(tokenizer):
    example = make(tokenizer, n=1)[0]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": example.user_message()}],
                                         add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    ids = rt.prompt_ids(tokenizer, example)
    assert ids[:len(chat)] == list(chat)  # exactly the template's tokens, then the prefix's
    assert tokenizer.decode(ids[len(chat):]) == example.answer_prefix == "The pass key is"
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nThere is an important pass key" in text
    assert text.endswith(f"{example.question}<|im_end|>\n<|im_start|>assistant\nThe pass key is")
    plain = char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        rt.prompt_ids(plain, example)


def test_a_known_answer_scores_1_and_a_wrong_one_0(tokenizer):
    passkey, multikey, aggregation = (next(e for e in make(tokenizer) if e.task == t)
                                      for t in ("passkey", "multikey", "aggregation"))
    assert scores(f"{passkey.answer}.", passkey) == {"exact_match": 1.0, "token_f1": 1.0, "item_recall": 1.0}
    assert scores("12345", passkey) == {"exact_match": 0.0, "token_f1": 0.0, "item_recall": 0.0}
    assert scores(f" {multikey.answer}", multikey)["exact_match"] == 1.0
    a, b, c = aggregation.items
    for right in (f"{a}, {b}, {c}", f"{c}, {a}, and {b}.", f"{b} {c} {a}"):  # any order, commas or "and"
        assert scores(right, aggregation) == {"exact_match": 1.0, "token_f1": 1.0, "item_recall": 1.0}
    partial = scores(f"{a}, {b}", aggregation)  # two of three: F1 = 2·1·(2/3)/(1 + 2/3) = 0.8
    assert partial["exact_match"] == 0.0 and partial["token_f1"] == pytest.approx(0.8)
    assert partial["item_recall"] == pytest.approx(2 / 3)
    assert item_recall(f"{a}0 {b}", (a,)) == 0.0  # a whole word, not a prefix of another number
    # the answer is the generation up to its first full stop or line break (generation stops there)
    assert first_sentence(f" {passkey.answer}. The pass key is the key.") == f"{passkey.answer}."
    assert first_sentence(f" {a}, {b}, and {c}.\nDone") == f"{a}, {b}, and {c}."
    assert first_sentence(":\n1. 123") == ":" and first_sentence(" 4 5") == "4 5"


# ---------------------------------------------------------------------------------------------
# One prefill, many arms, through generate()
# ---------------------------------------------------------------------------------------------
def test_every_arm_from_the_shared_prefill_equals_its_own_prefill_and_full_equals_plain_generate(tokenizer):
    from icml.methods.kv_compress.evaluation import variant_spec
    from icml.methods.kv_compress.hf_cache import CompressedCache
    from icml.methods.kv_compress.real import decode, record

    cfg = preset("real")
    cfg.window, cfg.max_new_tokens = 16, 6
    model = tiny_chat_llama(tokenizer)
    model.generation_config.eos_token_id = None  # random weights: decode the full length
    example = rt.real_set(["multikey"], 1, 0, "test", rt.token_counter(tokenizer), {"multikey": 300})[0]
    ids = torch.tensor([rt.prompt_ids(tokenizer, example)])
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    recorder = record(model, ids, cfg, column_sums=True)
    saved = [layer.full_keys.clone() for layer in recorder.layers]
    full = decode(model, tokenizer, ids, CompressedCache.sharing(recorder, model, "full", 1.0, 0.4, cfg), 6)
    assert first_sentence(tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)) == full["text"]
    assert len(full["text"]) >= 3  # keep-all = transformers' own cache, on a few generated tokens at least
    for name in REAL_VARIANTS[1:]:
        for ratio in (0.2,):
            shared = CompressedCache.sharing(recorder, model, name, ratio, 0.4, cfg)
            ours = decode(model, tokenizer, ids, shared, 6)
            own = record(model, ids, cfg, column_sums=variant_spec(name, cfg).operator == "h2o")
            alone = CompressedCache(model, name, ratio=ratio, h_bar=0.4, config=cfg)
            for mine, theirs in zip(alone.layers, own.layers):
                for key in ("seen", "full_keys", "full_values", "window_queries", "sums", "scaling", "shape",
                            "is_initialized", "device"):
                    setattr(mine, key, getattr(theirs, key))
            reference = decode(model, tokenizer, ids, alone, 6)
            assert ours["text"] == reference["text"], (name, ratio)
            torch.testing.assert_close(ours["first"], reference["first"], atol=1e-5, rtol=1e-5)
            for a, b in zip(shared.selection[0].kept, alone.selection[0].kept):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, ratio)
    assert all(torch.equal(a, layer.full_keys) for a, layer in zip(saved, recorder.layers))  # the prefill intact
    with pytest.raises(ValueError, match="column sums"):
        CompressedCache.sharing(record(model, ids, cfg, column_sums=False), model, "h2o", 0.3, None, cfg)


def test_the_real_preset():
    cfg = preset("real")
    assert (cfg.model, cfg.task_set, cfg.window, cfg.ratios, cfg.n_per_task) == (
        "smollm2-135m", "real", 32, [0.1, 0.2, 0.3, 0.5], 40)
    assert cfg.variants == ["full", "snapkv", "h2o", "streamingllm", "pyramidkv", "adakv", "entrokv_snapkv",
                            "entrokv_alpha0.25", "entrokv_perlayer", "entrokv_perlayer_alpha0.25"]
    assert cfg.real.tasks == list(rt.REAL_TASKS)
    validate(cfg)
    from icml.methods.kv_compress.evaluation import variant_spec

    arms = {name: variant_spec(name, cfg) for name in cfg.variants if name.startswith("entrokv")}
    assert {(s.alpha, s.scope) for s in arms.values()} == {(0.5, "global"), (0.25, "global"), (0.5, "per_layer"),
                                                          (0.25, "per_layer")}
    from icml.methods.kv_compress.config import SPEC_VARIANTS

    assert preset("default").variants == SPEC_VARIANTS and len(SPEC_VARIANTS) == 13  # the default's arms unchanged
    for key, value, message in (("model", None, "chat model"), ("variants", ["snapkv"], "full"),
                                ("variants", ["full", "entrokv_qagnostic"], "question-aware")):
        bad = preset("real")
        setattr(bad, key, value)
        with pytest.raises(ValueError, match=message):
            validate(bad)


# ---------------------------------------------------------------------------------------------
# End to end through the CLI: the real preset's config on a tiny chat Llama
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-chat")
    model = tiny_chat_llama(tokenizer)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# the real preset at test size: the tiny chat checkpoint, 1 prompt per task, lengths in its characters
TEST_SIZE = ["--set", "n_per_task=1", "--set", "n_calibration=2", "--set", "ratios=0.1,0.3", "--set", "max_new_tokens=2",
             "--set", "bootstrap=50", "--set", "real.tokens=250", "--set", "real.tokens_long=400"]


def test_train_eval_report_of_the_real_preset_and_an_interrupted_eval_continues(tmp_path, checkpoint, monkeypatch):
    runs = tmp_path / "runs"
    result = invoke("kv-compress", "train", "--preset", "real", "--model", checkpoint, *TEST_SIZE, "--runs-dir", runs,
                    "--json")
    assert result.code == 0, result.err
    run = Path(result.json()["run_dir"])
    assert result.json()["preset"] == "real"
    config = json.loads((run / "config.json").read_text())["config"]
    assert (config["task_set"], config["window"], config["variants"]) == ("real", 32, REAL_VARIANTS)
    calibration = json.loads((run / "calibration.json").read_text())[str(checkpoint)]
    assert calibration["data"] == "real tasks, calibration stream" and calibration["n"] == 2
    assert calibration["lines"] == ["passkey 0", "passkey_long 0"]  # held apart: its own stream, tasks in turn
    # eval stopped by SIGTERM (`timeout`'s signal) after 2 of the 4 examples, then run again: it continues
    restore = interrupt_progress(monkeypatch, lambda calls, units: units >= 2 and os.kill(os.getpid(), signal.SIGTERM))
    assert invoke("kv-compress", "eval", run, "--runs-dir", runs).code == 130
    assert json.loads((run / "run.json").read_text())["phases"]["eval"]["status"] == "interrupted"
    kept = sorted(p.name for p in (run / "checkpoints" / "real_eval").glob("*-00??.parquet"))
    assert len(kept) == 2
    restore()
    assert invoke("kv-compress", "eval", run, "--runs-dir", runs).code == 0
    resumed = pq.read_table(run / "examples.parquet").to_pandas()
    # the same eval from scratch gives the same rows (timings aside)
    for path in (run / "checkpoints" / "real_eval").glob("*.parquet"):
        path.unlink()
    assert invoke("kv-compress", "eval", run, "--runs-dir", runs).code == 0
    fresh = pq.read_table(run / "examples.parquet").to_pandas()
    timing = ["overhead_ms", "decode_ms", "prefill_ms"]
    pd.testing.assert_frame_equal(resumed.drop(columns=timing), fresh.drop(columns=timing))
    arms = len(REAL_VARIANTS)
    assert len(fresh) == 4 * arms * 2  # examples × arms × ratios (full's one decode stands for each ratio)
    assert set(fresh["task"]) == set(rt.REAL_TASKS) and set(fresh["ratio"]) == {0.1, 0.3}
    assert (fresh.loc[fresh["variant"] == "full", "kl_to_full"] == 0).all()
    assert (fresh.loc[fresh["variant"] == "full", "kept_fraction"] == 1).all()
    at = fresh[fresh["variant"] != "full"].groupby(["task", "example_id", "ratio"])["kept_entries"].nunique()
    assert (at == 1).all()  # every arm keeps the same number of entries at a ratio
    frame = pq.read_table(run / "metrics.parquet").to_pandas()
    evaluated = frame[frame["phase"] == "eval"]
    assert {"exact_match", "token_f1", "item_recall", "retention", "kl_to_full", "memory_bytes", "decode_ms",
            "prefill_ms", "em_diff_ci_low", "token_f1_diff_ci_high"} <= set(evaluated["metric"])
    paired = set(evaluated.loc[evaluated["metric"] == "em_diff_ci_low", "variant"])
    assert paired == {"entrokv_snapkv", "entrokv_alpha0.25", "entrokv_perlayer", "entrokv_perlayer_alpha0.25"}
    alpha = evaluated[evaluated["variant"] == "entrokv_perlayer_alpha0.25"]
    assert set(alpha["alpha"]) == {0.25} and set(alpha["scope"]) == {"per_layer"}
    allocations = pq.read_table(run / "allocations.parquet").to_pandas()
    quarter = allocations[allocations["variant"] == "entrokv_alpha0.25"]
    h_bar = calibration["h_bar"]
    assert quarter["signal"].to_numpy() == pytest.approx(0.75 * h_bar + 0.25 * quarter["entropy"].to_numpy())
    report = invoke("kv-compress", "report", run, "--runs-dir", runs, "--format", "markdown", "--out",
                    tmp_path / "r.md")
    assert report.code == 0, report.err
    assert "passkey_long" in (tmp_path / "r.md").read_text()
