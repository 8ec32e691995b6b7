"""--model: a GPT-2 checkpoint (the one family model.py drives), written here tiny and random with a
byte-level BPE tokenizer. Its core reproduces transformers' own forward with no module routed, the data
are tokenised by its own tokenizer (never characters into BPE rows), and check_inputs refuses what the
run cannot use before a run exists."""
from __future__ import annotations

import pytest
import torch

from icml.cli.errors import UsageError
from icml.methods.gradient_route.config import SUPPORTED_FAMILIES, check_inputs, preset


def _bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (GPT-2's kind) trained on a few synthetic stories, EOS <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from icml.methods.gradient_route.data import build_world, story

    world = build_world(0)
    texts = [story(world, 0, "train", topic, i) for topic in ("t0", "a0") for i in range(20)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A GPT-2 checkpoint directory with its tokenizer (tied head, as GPT-2's), and the same without it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("gpt2")
    tok = _bpe_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(root / "with_tokenizer")
    tok.save_pretrained(root / "with_tokenizer")
    model.save_pretrained(root / "no_tokenizer")
    return root


def _cfg(model, **settings):
    cfg = preset("smoke")
    cfg.model = str(model)
    for key, value in settings.items():
        setattr(cfg, key, value)
    return cfg


def test_the_core_reproduces_the_checkpoints_own_forward(gpt2):
    from transformers import GPT2LMHeadModel

    from icml.methods.gradient_route.model import build_model, deploy, forward

    path = gpt2 / "with_tokenizer"
    cfg = _cfg(path)
    model = build_model(cfg, 300, cfg.d_core, ["a0", "a1"], cfg.d_aux, seed=0)
    own = GPT2LMHeadModel.from_pretrained(path, local_files_only=True).eval()
    ids = torch.randint(0, 300, (3, cfg.gpt.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = own(input_ids=ids).logits
        # no module routed (profile core), and the served model with every module deleted: the checkpoint itself
        torch.testing.assert_close(forward(model, ids, route={}), expected, atol=0, rtol=0)
        torch.testing.assert_close(forward(deploy(model, []), ids), expected, atol=0, rtol=0)
        # a routed module adds to the core's output: the modules are really there
        assert not torch.equal(forward(model, ids, route={"a0": 1.0}), expected)
    # the tied head is untied into a core parameter of its own, equal at the start
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, own.lm_head.weight)


@pytest.mark.parametrize("data", ["synthetic", "folder"])
def test_the_data_are_tokenised_by_the_checkpoints_own_tokenizer(gpt2, tmp_path, data):
    from transformers import AutoTokenizer

    from icml.methods.gradient_route.data import build_corpus, build_world, story

    path = gpt2 / "with_tokenizer"
    own = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = _cfg(path)
    if data == "folder":
        for domain, text in (("core", "Tomo keeps the lamp. " * 60), ("a0", "Bira hid the kelo. " * 60)):
            (tmp_path / domain).mkdir()
            (tmp_path / domain / "doc.txt").write_text(text)
        cfg.data = str(tmp_path)
    corpus = build_corpus(cfg, 0)
    assert corpus.vocab_size == len(own) == 300  # characters would be 57 symbols
    if data == "synthetic":  # the first val windows of a0 are the BPE ids of a0's first val stories
        first = own(story(build_world(0), 0, "val", "a0", 0))["input_ids"]
        assert corpus.val["a0"][0].tolist() == first[: corpus.length]
    else:
        assert corpus.train("core", 1)[0].tolist() == own("Tomo keeps the lamp. " * 60)["input_ids"][: corpus.length]


def test_check_inputs_takes_a_gpt2_checkpoint_with_a_tokenizer(gpt2):
    check_inputs(_cfg(gpt2 / "with_tokenizer"))
    # a checkpoint saved without its tokenizer, with tokenizer= naming the one it was trained with
    check_inputs(_cfg(gpt2 / "no_tokenizer", tokenizer=str(gpt2 / "with_tokenizer")))


def test_check_inputs_refuses_what_the_run_cannot_use(gpt2, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # no tokenizer anywhere: the run would have fed character ids into the BPE embedding
    with pytest.raises(UsageError, match="has no tokenizer"):
        check_inputs(_cfg(gpt2 / "no_tokenizer"))
    with pytest.raises(UsageError, match=r"gpt\.context \(256\) is more than the 128 positions"):
        check_inputs(_cfg(gpt2 / "with_tokenizer", gpt=type(preset("smoke").gpt)(context=256)))
    # a tokenizer whose ids run past the checkpoint's embedding rows
    big = tmp_path / "big_tokenizer"
    _bpe_tokenizer(vocab_size=400).save_pretrained(big)
    assert len(AutoTokenizer.from_pretrained(big)) > 300
    with pytest.raises(UsageError, match="more than the 300 embedding rows"):
        check_inputs(_cfg(gpt2 / "with_tokenizer", tokenizer=str(big)))
    # another family: its blocks have no GPT2MLP to route
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32)).save_pretrained(tmp_path / "llama")
    with pytest.raises(UsageError, match="is a llama checkpoint; gradient-route supports gpt2"):
        check_inputs(_cfg(tmp_path / "llama"))
    assert SUPPORTED_FAMILIES == ("gpt2",)  # the families this file tests
