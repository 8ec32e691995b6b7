"""Corpora, the character tokenizer and the batch order of `icml spectral-optim`.

Three corpora feed the language-model grid:
- `generated`: toy-English sentences from a ~300-word lexicon (number agreement across relative
  clauses, so the model has long-range structure to learn) mixed with 20% arithmetic lines;
- `stdlib`: the Python standard library's `.py` sources, in sorted path order;
- `file`: a user's UTF-8 text file (`--data`).

Every run of a grid sees the same token stream and the same batches: batch i of a split is drawn
from a generator seeded by the run seed alone, so it does not depend on which run asks, or when.
"""
from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

UNKNOWN_TOKEN = "<unk>"
ARITHMETIC_FRACTION = 0.2
VAL_FRACTION = 0.1
STDLIB_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# ---------------------------------------------------------------------------------------------
# The toy-English lexicon. Nouns and verbs come in (singular, plural) pairs so that every verb
# can agree with its subject; ~300 distinct words in all.
# ---------------------------------------------------------------------------------------------
ANIMATE_NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("child", "children"), ("teacher", "teachers"),
    ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"), ("doctor", "doctors"),
    ("student", "students"), ("baker", "bakers"), ("sailor", "sailors"), ("wolf", "wolves"),
    ("fox", "foxes"), ("horse", "horses"), ("mouse", "mice"), ("man", "men"), ("woman", "women"),
    ("girl", "girls"), ("boy", "boys"), ("friend", "friends"), ("neighbor", "neighbors"),
    ("painter", "painters"), ("writer", "writers"), ("singer", "singers"), ("soldier", "soldiers"),
    ("pilot", "pilots"), ("monkey", "monkeys"), ("rabbit", "rabbits"), ("lion", "lions"),
    ("tiger", "tigers"), ("bear", "bears"), ("duck", "ducks"), ("goose", "geese"), ("judge", "judges"),
    ("nurse", "nurses"), ("cook", "cooks"), ("hunter", "hunters"), ("miner", "miners"), ("owl", "owls"),
]
THING_NOUNS = [
    ("apple", "apples"), ("book", "books"), ("box", "boxes"), ("river", "rivers"), ("house", "houses"),
    ("tree", "trees"), ("stone", "stones"), ("letter", "letters"), ("song", "songs"),
    ("garden", "gardens"), ("bridge", "bridges"), ("cake", "cakes"), ("ship", "ships"), ("key", "keys"),
    ("door", "doors"), ("window", "windows"), ("road", "roads"), ("city", "cities"), ("field", "fields"),
    ("lamp", "lamps"), ("coin", "coins"), ("map", "maps"), ("cup", "cups"), ("basket", "baskets"),
    ("flower", "flowers"), ("table", "tables"), ("wall", "walls"), ("hill", "hills"), ("boat", "boats"),
    ("clock", "clocks"),
]
TRANSITIVE_VERBS = [  # (third person singular, plural)
    ("sees", "see"), ("likes", "like"), ("finds", "find"), ("carries", "carry"), ("watches", "watch"),
    ("follows", "follow"), ("helps", "help"), ("paints", "paint"), ("builds", "build"), ("wants", "want"),
    ("chases", "chase"), ("remembers", "remember"), ("visits", "visit"), ("holds", "hold"),
    ("opens", "open"), ("reads", "read"), ("buys", "buy"), ("sells", "sell"), ("loves", "love"),
    ("fears", "fear"), ("knows", "know"), ("draws", "draw"), ("cleans", "clean"), ("moves", "move"),
    ("hides", "hide"),
]
INTRANSITIVE_VERBS = [
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("laughs", "laugh"), ("waits", "wait"),
    ("dances", "dance"), ("smiles", "smile"), ("walks", "walk"), ("swims", "swim"), ("cries", "cry"),
    ("works", "work"), ("jumps", "jump"), ("falls", "fall"), ("rests", "rest"), ("shouts", "shout"),
]
ADJECTIVES = [
    "big", "small", "old", "young", "red", "blue", "green", "happy", "sad", "quiet", "loud", "tall",
    "short", "bright", "dark", "clever", "lazy", "brave", "gentle", "angry", "tired", "hungry", "rich",
    "poor", "strange", "famous", "little", "heavy", "light", "warm", "cold", "soft", "hard", "wild",
    "calm", "proud", "kind", "busy", "slow", "quick",
]
ADVERBS = ["quickly", "slowly", "quietly", "often", "rarely", "happily", "sadly", "again", "today",
           "always", "never", "early", "late", "here", "there"]
SINGULAR_DETERMINERS = ["the", "a", "every", "this", "that", "one", "each"]
PLURAL_DETERMINERS = ["the", "some", "many", "these", "those", "all", "two", "three", "few"]
PREPOSITIONS = ["near", "behind", "under", "beside", "above", "with", "without", "inside", "across", "over"]
CONJUNCTIONS = ["and", "but", "because", "while"]


class ToyEnglish:
    """A tiny agreement grammar: S -> NP VP, NP -> Det (Adj) N (RelClause), with the verb of every
    clause agreeing in number with that clause's subject."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def noun_phrase(self, plural: bool, animate: bool, relative_clause_ok: bool) -> str:
        rng = self.rng
        singular_form, plural_form = rng.choice(ANIMATE_NOUNS if animate else THING_NOUNS)
        words = [rng.choice(PLURAL_DETERMINERS if plural else SINGULAR_DETERMINERS)]
        if rng.random() < 0.4:
            words.append(rng.choice(ADJECTIVES))
        words.append(plural_form if plural else singular_form)
        if words[0] == "a" and words[1][0] in "aeiou":
            words[0] = "an"
        phrase = " ".join(words)
        if relative_clause_ok and rng.random() < 0.3:
            phrase += " " + self.relative_clause(plural, animate)
        return phrase

    def relative_clause(self, head_plural: bool, head_animate: bool) -> str:
        """Subject relatives make the inner verb agree with the head noun ('the dogs that chase the
        cat'); object relatives make it agree with a new inner subject ('the book that the girls read')."""
        rng = self.rng
        if head_animate and rng.random() < 0.5:
            return f"{rng.choice(['who', 'that'])} {self.verb_phrase(head_plural, objects_may_branch=False)}"
        inner_plural = rng.random() < 0.5
        inner_subject = self.noun_phrase(inner_plural, animate=True, relative_clause_ok=False)
        verb = rng.choice(TRANSITIVE_VERBS)[inner_plural]
        return f"{'that' if head_animate else rng.choice(['that', 'which'])} {inner_subject} {verb}"

    def verb_phrase(self, plural: bool, objects_may_branch: bool) -> str:
        rng = self.rng
        if rng.random() < 0.6:
            verb = rng.choice(TRANSITIVE_VERBS)[plural]
            obj = self.noun_phrase(rng.random() < 0.5, animate=rng.random() < 0.5,
                                   relative_clause_ok=objects_may_branch)
            phrase = f"{verb} {obj}"
        else:
            phrase = rng.choice(INTRANSITIVE_VERBS)[plural]
            if rng.random() < 0.4:
                phrase += " " + rng.choice(ADVERBS)
        if rng.random() < 0.25:
            place = self.noun_phrase(rng.random() < 0.5, animate=False, relative_clause_ok=False)
            phrase += f" {rng.choice(PREPOSITIONS)} {place}"
        return phrase

    def clause(self) -> str:
        plural = self.rng.random() < 0.5
        subject = self.noun_phrase(plural, animate=True, relative_clause_ok=True)
        return f"{subject} {self.verb_phrase(plural, objects_may_branch=True)}"

    def sentence(self) -> str:
        text = self.clause()
        if self.rng.random() < 0.15:
            text += f", {self.rng.choice(CONJUNCTIONS)} {self.clause()}"
        return text[0].upper() + text[1:] + "."


def arithmetic_line(rng: random.Random) -> str:
    """`a + b = c` with operands of 1 to 3 digits, always summed correctly."""
    a, b = (rng.randrange(10 ** rng.randint(1, 3)) for _ in range(2))
    return f"{a} + {b} = {a + b}"


def generated_corpus(seed: int, n_chars: int) -> str:
    """Exactly `n_chars` characters of newline-separated lines, 20% of them arithmetic; the
    last line may be cut short. Deterministic for a seed (Python's own Mersenne Twister)."""
    rng = random.Random(seed)
    grammar = ToyEnglish(rng)
    lines: list[str] = []
    length = 0
    while length < n_chars:
        line = arithmetic_line(rng) if rng.random() < ARITHMETIC_FRACTION else grammar.sentence()
        lines.append(line)
        length += len(line) + 1
    return "\n".join(lines)[:n_chars]


def stdlib_sources() -> list[Path]:
    """The standard library's `.py` files in sorted order, without third-party packages or tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py")
                  if not STDLIB_SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]))


def stdlib_corpus(n_chars: int) -> str:
    """The first `n_chars` characters of the sorted standard-library sources, files separated by a
    blank line; files that are not valid UTF-8 are skipped."""
    pieces: list[str] = []
    length = 0
    for path in stdlib_sources():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        pieces.append(source)
        length += len(source) + 2
        if length >= n_chars:
            break
    text = "\n\n".join(pieces)[:n_chars]
    if not text:
        raise ValueError(f"no readable .py files under {sysconfig.get_paths()['stdlib']} — "
                         "use the generated corpus or --data FILE.txt")
    return text


def read_text_file(path: str | Path) -> str:
    """A user's corpus, whole; one-line ValueErrors for what cannot be used."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read data file '{path}' ({exc.strerror or exc}) — "
                         "pass a readable UTF-8 text file with --data") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"data file '{path}' is not UTF-8 (bad byte at offset {exc.start}) — "
                         "re-encode it as UTF-8, e.g. iconv -t UTF-8") from None
    if not text.strip():
        raise ValueError(f"data file '{path}' is empty — pass a text file with content")
    return text


def load_corpus(corpus: str, seed: int, n_chars: int, data: str | None = None) -> str:
    """The text of `corpus` (generated | stdlib | file); a file is used whole, not truncated."""
    if corpus == "generated":
        return generated_corpus(seed, n_chars)
    if corpus == "stdlib":
        return stdlib_corpus(n_chars)
    if corpus == "file":
        if not data:
            raise ValueError("corpus=file needs a text file — pass --data FILE.txt")
        return read_text_file(data)
    raise ValueError(f"unknown corpus '{corpus}' — use generated, stdlib or file")


# ---------------------------------------------------------------------------------------------
# The character tokenizer: a WordLevel vocabulary over single characters, so that encode/decode
# is an exact round trip and the vocabulary is whatever characters the corpus holds.
# ---------------------------------------------------------------------------------------------
def build_char_tokenizer(text: str):
    """A `PreTrainedTokenizerFast` with one id per distinct character of `text` (sorted, so the
    ids depend on the character set only) plus `<unk>` at id 0 for characters it has not seen."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {UNKNOWN_TOKEN: 0}
    for char in sorted(set(text)):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNKNOWN_TOKEN))
    # every character is its own pre-token; [\s\S] also matches newlines, unlike "."
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate the characters back, no spaces between them
    # split_special_tokens: a literal "<unk>" in the text stays five characters, so the round
    # trip is exact for any text made of known characters
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNKNOWN_TOKEN,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True)


def load_tokenizer(path: str | Path):
    """A tokenizer saved with `save_pretrained`, from the local directory only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


ENCODE_CHUNK_CHARS = 100_000


def encode(tokenizer, text: str) -> torch.Tensor:
    """The token ids of `text` as one int64 tensor. The text goes to the tokenizer as ~100k-char
    chunks cut at line ends: one call for the whole list is parallel inside the tokenizer, and a
    sub-word tokenizer never sees a word split in two."""
    chunks: list[str] = []
    current: list[str] = []
    current_chars = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        current_chars += len(line)
        if current_chars >= ENCODE_CHUNK_CHARS:
            chunks.append("".join(current))
            current, current_chars = [], 0
    if current:
        chunks.append("".join(current))
    # verbose=False: the stream is cut into model-sized windows later, so a chunk longer than the
    # model's context is expected, not worth the tokenizer's warning
    encoded = tokenizer(chunks, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor([token for ids in encoded for token in ids], dtype=torch.long)


def split_train_val(token_ids: torch.Tensor, block_size: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 90% of the stream for training, the last 10% for validation (contiguous, so no
    window straddles both). Each split must hold at least two windows of block_size+1 tokens."""
    n_val = int(len(token_ids) * VAL_FRACTION)
    train_ids, val_ids = token_ids[:len(token_ids) - n_val], token_ids[len(token_ids) - n_val:]
    needed = block_size + 2
    if len(val_ids) < needed:
        raise ValueError(f"{source} gives {len(token_ids)} tokens, so its 10% validation split has "
                         f"{len(val_ids)} < block_size+2 = {needed} — use a text of at least "
                         f"{needed * 10} tokens, or lower --set block_size")
    return train_ids, val_ids


class WindowBatches:
    """Batch i = `batch_size` random windows of block_size+1 consecutive tokens (inputs are the
    first block_size, targets the last block_size). Window starts come from one generator seeded
    by `seed` and are drawn in order and cached, so batch i is the same whoever asks for it first."""

    def __init__(self, token_ids: torch.Tensor, batch_size: int, block_size: int, seed: int):
        if len(token_ids) < block_size + 2:
            raise ValueError(f"{len(token_ids)} tokens cannot hold two windows of {block_size + 1}")
        self.token_ids = token_ids
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(block_size + 1)
        self.starts: list[torch.Tensor] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        while len(self.starts) <= index:
            last_start = len(self.token_ids) - self.block_size - 1
            self.starts.append(torch.randint(0, last_start + 1, (self.batch_size,), generator=self.generator))
        return self.token_ids[self.starts[index][:, None] + self.offsets]


@dataclass
class LMBatches:
    """The batch order of one run seed: `train[step]` and `val[i]` (the fixed val batches)."""

    train: WindowBatches
    val: WindowBatches


def make_batches(train_ids: torch.Tensor, val_ids: torch.Tensor, batch_size: int, block_size: int,
                 seed: int) -> LMBatches:
    # two disjoint seeds per run seed: train and val streams never coincide across run seeds
    return LMBatches(train=WindowBatches(train_ids, batch_size, block_size, seed=2 * seed),
                     val=WindowBatches(val_ids, batch_size, block_size, seed=2 * seed + 1))


@dataclass
class LMData:
    """Everything a grid shares: the tokenizer, both token streams and the batch order."""

    tokenizer: object
    train_ids: torch.Tensor
    val_ids: torch.Tensor
    batches: LMBatches
    source: str  # a human description, e.g. "generated corpus (2,000,000 chars)"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def prepare_data(cfg, seed: int, tokenizer=None) -> LMData:
    """The corpus of `cfg`, tokenised with `tokenizer` (a `--model`'s own) or, when None, with a
    character tokenizer built over the corpus; split and batched for run seed `seed`."""
    text = load_corpus(cfg.corpus, seed, cfg.corpus_chars, cfg.data)
    source = {"generated": "generated corpus", "stdlib": "Python stdlib sources",
              "file": f"data file '{cfg.data}'"}[cfg.corpus]
    source += f" ({len(text):,} chars)"
    if tokenizer is None:
        tokenizer = build_char_tokenizer(text)
    token_ids = encode(tokenizer, text)
    train_ids, val_ids = split_train_val(token_ids, cfg.block_size, source)
    batches = make_batches(train_ids, val_ids, cfg.batch_size, cfg.block_size, seed)
    return LMData(tokenizer, train_ids, val_ids, batches, source)
