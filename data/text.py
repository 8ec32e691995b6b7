"""Text helpers shared by methods that train tiny language models on generated word-level data."""
from __future__ import annotations

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0–3 in every word vocabulary built here


def word_level_tokenizer(vocab: list[str]):
    """A `PreTrainedTokenizerFast` over `vocab` (which starts with SPECIAL): whitespace split, unknown
    words to `<unk>`, `<bos>` prepended; `save_pretrained` / `from_pretrained` round-trip it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab[:len(SPECIAL)] != SPECIAL:
        raise ValueError(f"a word vocabulary must start with {SPECIAL}")
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
