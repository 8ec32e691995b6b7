"""The controller on a real-model-like tokenizer: a byte-level BPE (the kind of Qwen / GPT-2, built
in memory from explicit merges) whose vocabulary splits " Alternatively" into " Altern" + "atively"
and writes the answer `\\frac{3}{4}}` as `\\frac{`, `3}`, `{4`, `}}`. The reasoner is a real float64
HF Llama whose attention and MLP outputs are zeroed (o_proj, down_proj), so its next token depends
on the last token alone: a bigram table written into the embedding and the LM head, which scripts
the trace exactly. Checked: the probe reads a nested-brace answer whole, with the reader of the
final answer, and its confidence is the mean probability of all its tokens (from an independent
full forward); the oracle and the first-error subset see that answer; an ATP word the tokenizer
splits triggers at the word's start, and vanilla stays HF greedy decoding; a word the tokenizer
cannot write is refused before the run."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from icml.methods.reason_stop.config import check_inputs, preset
from icml.methods.reason_stop.controller import EXIT, AttentionRecorder, Codec, Session, generate, probe
from icml.methods.reason_stop.data import last_boxed, read_answer
from icml.methods.reason_stop.evaluation import first_error_ids, tables

EOS = "<|endoftext|>"
MERGES = [  # in rank order: " Alternatively" → " Altern" + "atively"; "\frac{3}{4}}" → \frac{ 3} {4 }}
    ("Ġ", "A"), ("ĠA", "l"), ("ĠAl", "t"), ("ĠAlt", "e"), ("ĠAlte", "r"), ("ĠAlter", "n"),
    ("a", "t"), ("at", "i"), ("ati", "v"), ("ativ", "e"), ("ative", "l"), ("ativel", "y"),
    ("\\", "f"), ("\\f", "r"), ("\\fr", "a"), ("\\fra", "c"), ("\\frac", "{"),
    ("3", "}"), ("{", "4"), ("}", "}"),
]
ANSWER = ["\\frac{", "3}", "{4", "}}"]  # the brace-nested answer, as the model writes it
# the bigram script: thinking loops " Alternatively,." from <think>; after a probe string or exit
# suffix ending in "\boxed{" comes the answer and <eos>; after one ending in " [" comes "7", a lone "}"
NEXT = {"<think>": "ĠAltern", "ĠAltern": "atively", "atively": ",", ",": ".", ".": "ĠAltern",
        "{": ANSWER[0], ANSWER[0]: ANSWER[1], ANSWER[1]: ANSWER[2], ANSWER[2]: ANSWER[3], ANSWER[3]: EOS,
        "[": "7", "7": "}", "}": EOS}
# logits of the answer tokens: the last two far less likely, so a mean over part of the answer is far off
LOGIT = {ANSWER[0]: 9.0, ANSWER[1]: 8.5, ANSWER[2]: 6.0, ANSWER[3]: 5.0}
QUESTION = "Q: 3/4?"
TRUTH = "\\frac{3}{4}"
EPS32 = torch.finfo(torch.float32).eps  # the controller's probabilities are float32


def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab, MERGES))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


@pytest.fixture(scope="module")
def setup():
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = bpe_tokenizer()
    assert tokenizer.tokenize(" Alternatively") == ["ĠAltern", "atively"]  # the split under test
    assert tokenizer.tokenize("\\boxed{" + TRUTH + "}")[-4:] == ANSWER
    vocab, hidden = len(tokenizer), 280
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).double().eval()
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:  # attention is computed (and recorded) but adds nothing
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden, dtype=torch.float64))
        head = model.lm_head.weight
        head.zero_()
        for token, successor in NEXT.items():
            # the final RMSNorm scales a one-hot row by √hidden
            head[ids(successor), ids(token)] = LOGIT.get(successor, 10.0) / hidden ** 0.5
    cfg = preset("smoke")
    cfg.atp_words, cfg.n_last_layers, cfg.max_new_tokens, cfg.answer_max_tokens = ["Alternatively"], 2, 12, 8
    cfg.probe_string, cfg.probe_terminator = "\n\n\\boxed{", "}"
    cfg.exit_suffix, cfg.think_end, cfg.probe_max_tokens = "</think>\n\n\\boxed{", "</think>", 16
    return model, tokenizer, cfg


def run(setup, variant: str, **overrides):
    model, tokenizer, cfg = setup
    cfg = dataclasses.replace(cfg, **overrides)
    codec = Codec(tokenizer, model, cfg)
    recorder = AttentionRecorder(model, cfg.n_last_layers)
    try:
        return generate(model, codec, recorder, QUESTION, TRUTH, variant, cfg, "cpu"), codec
    finally:
        recorder.remove()


def boxed_data(tmp_path) -> str:
    """A --data file: its presence makes answers compare as normalised \\boxed{} contents."""
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"question": QUESTION, "answer": f"\\boxed{{{TRUTH}}}"}) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------
# The probe answer: brace-matched, every token scored
# ---------------------------------------------------------------------------------------------
def test_reader_matches_braces_and_is_the_final_answers():
    assert read_answer("\\frac{3}{4}} and more") == ("\\frac{3}{4}", True)
    assert read_answer("5}") == ("5", True)
    assert read_answer("\\frac{3}{4") == ("\\frac{3}{4", False)  # unclosed: what there is
    assert read_answer("3 <eos> 4", "<eos>") == ("3 ", True)  # the synthetic terminator
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{3}{4}}.") == "\\frac{3}{4}"


def probe_after_prompt(setup, probe_string: str):
    model, tokenizer, cfg = setup
    cfg = dataclasses.replace(cfg, probe_string=probe_string)
    codec = Codec(tokenizer, model, cfg)
    recorder = AttentionRecorder(model, cfg.n_last_layers)
    session = Session(model, recorder, "cpu")
    prompt = codec.prompt_ids(QUESTION, False)
    session.feed(prompt)
    try:
        found = probe(session, codec, cfg, atp_ids=tokenizer(" Alternatively")["input_ids"])
    finally:
        recorder.remove()
    # the reference: one full forward (no cache) over prompt + probe string + answer, each row's
    # logits taken to float32 before the softmax as the controller takes them
    ids = prompt + codec.probe_ids + found.answer_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    start = len(prompt) + len(codec.probe_ids)
    reference = [float(logits[start - 1 + k].float().softmax(-1)[token]) for k, token in enumerate(found.answer_ids)]
    return found, codec, reference


def test_probe_reads_a_nested_brace_answer_whole(setup):
    """`\\boxed{\\frac{3}{4}}` probes as `\\frac{3}{4}` (it used to stop at the first `}`: `\\frac{3`),
    and C is the mean over its four tokens, the last `}}` included: it carries the answer's last brace."""
    model, tokenizer, cfg = setup
    found, codec, reference = probe_after_prompt(setup, cfg.probe_string)
    assert found.answer == TRUTH
    assert found.answer_ids == tokenizer.convert_tokens_to_ids(ANSWER)
    assert found.tokens == len(codec.probe_ids) + len(ANSWER)  # nothing decoded past the closing brace
    assert found.probs == pytest.approx(reference, rel=EPS32)
    assert found.confidence == pytest.approx(sum(reference) / 4, rel=EPS32)
    assert abs(found.confidence - sum(reference[:2]) / 2) > 0.2  # the old two-token mean


def test_a_terminator_token_that_adds_nothing_is_not_scored(setup):
    """" [" → "7", then a lone "}": the answer is "7", scored on its one token; the "}" closes it."""
    model, tokenizer, cfg = setup
    found, codec, reference = probe_after_prompt(setup, "Answer: [")
    assert found.answer == "7" and found.answer_ids == tokenizer.convert_tokens_to_ids(["7"])
    assert found.confidence == pytest.approx(reference[0], rel=EPS32)
    assert found.tokens == len(codec.probe_ids) + 2


def test_oracle_and_first_error_subset_see_the_whole_answer(setup, tmp_path):
    """With ATP word "," (one token, detected before and after this change) and boxed answers, the
    first probe reads `\\frac{3}{4}` = the truth: the oracle exits there, and the problem is not in
    the first-error subset (with the old `\\frac{3` the oracle never exited and the problem was)."""
    generation, codec = run(setup, "oracle_first_correct", atp_words=[","], data=boxed_data(tmp_path))
    first = generation.events[0]
    assert first["probe_answer"] == TRUTH and first["probe_correct"] is True and first["action"] == EXIT
    assert generation.n_atp == 1 and generation.answer == TRUTH and generation.correct
    _, events = tables([dataclasses.asdict(generation)], "run")
    assert first_error_ids(events) == set()


# ---------------------------------------------------------------------------------------------
# An ATP word the tokenizer splits
# ---------------------------------------------------------------------------------------------
def test_a_split_atp_word_triggers_at_its_start(setup, tmp_path):
    model, tokenizer, cfg = setup
    loop = tokenizer.convert_tokens_to_ids(["ĠAltern", "atively", ",", "."])
    vanilla, codec = run(setup, "vanilla")
    prompt = codec.prompt_ids(QUESTION, False)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                   eos_token_id=0, pad_token_id=0)[0, len(prompt):].tolist()
    assert vanilla.output_ids == reference == loop * 3  # taking the word back out and re-feeding it changes nothing
    assert [e["position"] for e in vanilla.events] == [0, 4, 8]
    assert {e["word"] for e in vanilla.events} == {"Alternatively"}
    # probing controllers that never exit: the same trace, every ATP probed, with the probe before
    # the word or after all of its tokens
    for position in ("before", "after"):
        deer, _ = run(setup, "deer", lam=1.1, probe_position=position)
        assert deer.output_ids == vanilla.output_ids and deer.n_atp == 3
        prefix = (2 if position == "after" else 0) + len(codec.probe_ids)
        assert deer.probe_tokens == 3 * (prefix + len(ANSWER))
        assert {e["probe_answer"] for e in deer.events} == {TRUTH}
    # an exit at the first ATP drops the whole word, not only its last token
    early, _ = run(setup, "deer", lam=-1.0, data=boxed_data(tmp_path))
    assert early.events[0]["action"] == EXIT and early.events[0]["position"] == 0
    assert early.output_ids == codec.exit_ids + tokenizer.convert_tokens_to_ids(ANSWER + [EOS])
    assert early.answer == TRUTH


def test_an_unwritable_atp_word_is_refused_before_the_run(setup, tmp_path):
    model, tokenizer, cfg = setup
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    check_inputs(dataclasses.replace(cfg, model=str(folder)))  # the split word: accepted
    with pytest.raises(ValueError, match="ATP word 'Wait' cannot be written by the synthetic word tokenizer"):
        check_inputs(dataclasses.replace(preset("smoke"), atp_words=["wait", "Wait"]))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_supported_family_runs_the_controller_as_greedy_decoding(setup, tmp_path, family):
    """Each --model family (config.SUPPORTED_FAMILIES), saved and loaded through the shared checkpoint path:
    the same scripted weights give the same trace, the controller's vanilla loop is transformers' greedy
    generate(), and the split ATP word triggers at the same positions (the recorder reads the family's
    eager attention)."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    from icml.methods.reason_stop.config import SUPPORTED_FAMILIES
    from icml.methods.reason_stop.model import load_checkpoint

    assert family in SUPPORTED_FAMILIES
    scripted, tokenizer, cfg = setup
    sizes = {k: getattr(scripted.config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
        "tie_word_embeddings")}
    config = {"llama": type(scripted.config), "mistral": MistralConfig, "qwen2": Qwen2Config,
              "qwen3": Qwen3Config}[family](**sizes)
    if family == "qwen3":
        config.head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    model = AutoModelForCausalLM.from_config(config)
    mine = model.state_dict()
    with torch.no_grad():  # the scripted weights where the family has them; its extras (norms, biases) as drawn
        for name, value in scripted.state_dict().items():
            mine[name].copy_(value)
    model.save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    check_inputs(dataclasses.replace(cfg, model=str(tmp_path / family)))
    loaded, loaded_tokenizer = load_checkpoint(tmp_path / family)
    assert loaded.config.model_type == family
    vanilla, codec = run((loaded, loaded_tokenizer, cfg), "vanilla")
    prompt = codec.prompt_ids(QUESTION, False)
    with torch.no_grad():
        reference = loaded.generate(torch.tensor([prompt]), max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                    eos_token_id=0, pad_token_id=0)[0, len(prompt):].tolist()
    loop = tokenizer.convert_tokens_to_ids(["ĠAltern", "atively", ",", "."])
    assert vanilla.output_ids == reference == loop * 3
    assert [e["position"] for e in vanilla.events] == [0, 4, 8]
