"""The labelled corpora of GRAM: the synthetic topic-story corpus, and user text domains.

Synthetic: 12 topics (t0–t7 core, a0–a3 auxiliary) of character-level stories over one fixed
alphabet. Every word is built from the same syllables, so a model without a topic's module still
sees no unseen token: what it loses is the topic's names, objects and entity → object facts. Each
story is seeded by SeedSequence([seed, stream, topic, index]), so the corpus is a pure function
of the seed and every split is a prefix-stable stream of windows. With `--model` (or `tokenizer=`)
the same stories are tokenised by that tokenizer instead of by characters.

User data: `data=DIR` with one subfolder per domain (`core` is D₁, `unlabelled` optional); files
*.txt (one document), *.jsonl or *.parquet (one document per record's `text`); a document goes
to val when sha256(key) mod 20 == 0, to attack when it is 1, else to train.

`select` (synthetic only) is a held-apart stream drawn like val (every entity) that neither training
nor any reported metric reads: MaxEnt's λ sweep picks its λ there, never on val.
"""
from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from icml.methods.gradient_route.config import AUX_TOPICS, CORE_TOPICS

PAD = "\x00"
ALPHABET = PAD + string.ascii_lowercase + string.ascii_uppercase + " .,\n"
TOPICS = CORE_TOPICS + AUX_TOPICS
STREAMS = {"train": 0, "val": 1, "attack": 2, "val_heldout": 3, "select": 4}
WORLD_STREAM = 7
ONSETS = list("bdfgklmnprstvz")
VOWELS = list("aeiou")
CODAS = list("nrl")
N_ENTITIES, N_OBJECTS, N_SHARED_NAMES = 40, 20, 20
ATTACK_ENTITIES = range(0, 10)  # the attacker's facts
HELDOUT_ENTITIES = range(10, 40)  # facts the attacker never sees: recovery there is latent retention
PLACES = ["market", "river", "garden", "harbor", "forest", "tower", "bridge", "valley", "temple", "meadow",
          "library", "castle"]
VERBS = ["sang", "waited", "laughed", "slept", "danced", "listened", "worked", "rested", "smiled", "cooked",
         "read", "wrote", "painted", "played", "talked", "wandered"]
FACT_TEMPLATES = ["{E} keeps the {o}.", "The {o} belongs to {E}.", "{E} found the {o}.", "{E} hid the {o}.",
                  "Everyone knows that {E} has the {o}.", "{E} never lends the {o}."]
GENERIC_TEMPLATES = ["{N} walked to the {p}.", "{N} {v} near the {p}.", "In the {p}, {N} {v}.",
                     "{N} and {M} {v} by the {p}.", "The {p} was quiet.", "{N} {v} all day.",
                     "Then {N} went home.", "{N} saw the {p} again."]
FACT_PROB = 0.6
SUFFIXES = (".txt", ".jsonl", ".parquet")


class CharTokenizer:
    """Characters → ids; id 0 is padding, unseen characters map to <unk> when the vocabulary has one."""

    def __init__(self, chars: str, unk: bool = False):
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.unk_id = len(chars) if unk else None
        self.pad_id = 0

    def __len__(self) -> int:
        return len(self.chars) + (self.unk_id is not None)

    def encode(self, text: str) -> list[int]:
        if self.unk_id is None:
            return [self.index[c] for c in text]
        return [self.index.get(c, self.unk_id) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "\ufffd" for i in ids)


class HFTokenizer:
    """A local transformers tokenizer (`tokenizer=DIR`), documents separated by its EOS token."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self.inner = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"tokenizer '{path}' cannot be loaded ({str(exc).splitlines()[0]})") from None
        self.pad_id = self.inner.pad_token_id if self.inner.pad_token_id is not None else -100
        self.sep = [self.inner.eos_token_id] if self.inner.eos_token_id is not None else []

    def __len__(self) -> int:
        return len(self.inner)

    def encode(self, text: str) -> list[int]:
        return self.inner(text)["input_ids"]

    def decode(self, ids) -> str:
        return self.inner.decode(list(ids))


def _cut(ids: list[int], n: int, length: int) -> torch.Tensor:
    return torch.tensor(ids[: n * length], dtype=torch.long).view(n, length)


# --- synthetic world -------------------------------------------------------------------------------
@dataclass
class World:
    """Names, objects and the entity → object fact table of every topic; shared names."""

    entities: dict[str, list[str]]
    objects: dict[str, list[str]]
    facts: dict[str, list[int]]  # topic -> object index of each entity
    names: list[str]


def _word(rng: np.random.Generator, syllables: int) -> str:
    parts = []
    for _ in range(syllables):
        part = ONSETS[rng.integers(len(ONSETS))] + VOWELS[rng.integers(len(VOWELS))]
        if rng.random() < 0.25:
            part += CODAS[rng.integers(len(CODAS))]
        parts.append(part)
    return "".join(parts)


def build_world(seed: int) -> World:
    rng = np.random.default_rng(np.random.SeedSequence([seed, WORLD_STREAM]))
    used = set(PLACES) | set(VERBS)

    def unique(n: int, syllables, capital: bool) -> list[str]:
        out = []
        while len(out) < n:
            word = _word(rng, int(rng.choice(syllables)))
            word = word.capitalize() if capital else word
            if word.lower() not in used:
                used.add(word.lower())
                out.append(word)
        return out

    names = unique(N_SHARED_NAMES, [2], True)
    entities, objects, facts = {}, {}, {}
    for topic in TOPICS:
        entities[topic] = unique(N_ENTITIES, [2, 3], True)
        objects[topic] = unique(N_OBJECTS, [2], False)
        facts[topic] = rng.integers(N_OBJECTS, size=N_ENTITIES).tolist()
    return World(entities, objects, facts, names)


def story(world: World, seed: int, split: str, topic: str, index: int) -> str:
    """One story: 6–10 sentences, each a fact of the topic (p 0.6) or a generic one, then a newline."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, STREAMS[split], TOPICS.index(topic), index]))
    pool = (ATTACK_ENTITIES if split == "attack" else HELDOUT_ENTITIES if split == "val_heldout"
            else range(N_ENTITIES))
    sentences = []
    for _ in range(int(rng.integers(6, 11))):
        if rng.random() < FACT_PROB:
            entity = pool[int(rng.integers(len(pool)))]
            template = FACT_TEMPLATES[rng.integers(len(FACT_TEMPLATES))]
            sentence = template.format(E=world.entities[topic][entity],
                                       o=world.objects[topic][world.facts[topic][entity]])
        else:
            template = GENERIC_TEMPLATES[rng.integers(len(GENERIC_TEMPLATES))]
            first, second = rng.choice(len(world.names), size=2, replace=False)
            sentence = template.format(N=world.names[first], M=world.names[second],
                                       p=PLACES[rng.integers(len(PLACES))], v=VERBS[rng.integers(len(VERBS))])
        sentences.append(sentence)
    return " ".join(sentences) + "\n"


# --- the corpus the pipeline sees --------------------------------------------------------------------
@dataclass
class Corpus:
    """Labelled domains: core (D₁) first, then the auxiliary ones, and optionally `unlabelled`.

    `train(domain, n)` returns n windows of length+1 tokens (prefix-stable in n); val, attack and
    val_heldout are fixed window sets per dataset. `val_topics` holds the core val windows' topics.
    """

    tokenizer: object
    aux: list[str]
    length: int  # tokens per window (context + 1: inputs and shifted targets)
    source: str
    val: dict[str, torch.Tensor] = field(default_factory=dict)
    val_heldout: dict[str, torch.Tensor] = field(default_factory=dict)
    attack: dict[str, torch.Tensor] = field(default_factory=dict)
    select: dict[str, torch.Tensor] = field(default_factory=dict)
    val_topics: list[str] = field(default_factory=list)
    has_unlabelled: bool = False

    @property
    def domains(self) -> list[str]:
        return ["core", *self.aux]

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def train(self, domain: str, n: int) -> torch.Tensor:
        raise NotImplementedError


class SyntheticCorpus(Corpus):
    def __init__(self, seed: int, context: int, val_windows: int, attack_windows: int, tokenizer: str | None = None):
        tok = HFTokenizer(tokenizer) if tokenizer is not None else CharTokenizer(ALPHABET)
        super().__init__(tok, list(AUX_TOPICS), context + 1, "synthetic topic stories")
        self.seed = seed
        self.world = build_world(seed)
        self._streams: dict[tuple[str, str], list[int]] = {}
        self._stories: dict[tuple[str, str], int] = {}
        per_core = max(1, val_windows // len(CORE_TOPICS))
        for split, target in (("val", self.val), ("select", self.select)):
            target["core"] = torch.cat([self.windows(split, t, per_core) for t in CORE_TOPICS])
            for topic in AUX_TOPICS:
                target[topic] = self.windows(split, topic, val_windows)
        self.val_topics = [t for t in CORE_TOPICS for _ in range(per_core)]
        for topic in AUX_TOPICS:
            self.val_heldout[topic] = self.windows("val_heldout", topic, val_windows)
            self.attack[topic] = self.windows("attack", topic, attack_windows)

    def windows(self, split: str, topic: str, n: int) -> torch.Tensor:
        """The first n windows of one topic's story stream of a split."""
        key = (split, topic)
        ids = self._streams.setdefault(key, [])
        while len(ids) < n * self.length:
            index = self._stories.get(key, 0)
            ids += self.tokenizer.encode(story(self.world, self.seed, split, topic, index))
            self._stories[key] = index + 1
        return _cut(ids, n, self.length)

    def train(self, domain: str, n: int) -> torch.Tensor:
        if domain != "core":
            return self.windows("train", domain, n)
        per_topic = -(-n // len(CORE_TOPICS))  # round-robin over t0–t7: a prefix stays balanced
        stacked = torch.stack([self.windows("train", t, per_topic) for t in CORE_TOPICS], dim=1)
        return stacked.reshape(-1, self.length)[:n]


def _documents(folder: Path, root: Path) -> list[tuple[str, str]]:
    """(split key, text) of every document under a domain folder, in a stable order."""
    docs = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES):
        rel = path.relative_to(root).as_posix()
        suffix = path.suffix.lower()
        try:
            if suffix == ".txt":
                docs.append((rel, path.read_text(encoding="utf-8")))
            elif suffix == ".jsonl":
                for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                    if line.strip():
                        docs.append((f"{rel}:{i}", _text_field(json.loads(line), path)))
            else:
                import pyarrow.parquet as pq

                table = pq.read_table(path)
                if "text" not in table.column_names:
                    raise ValueError(f"'{path}' has no 'text' column (columns: {', '.join(table.column_names)})")
                docs += [(f"{rel}:{i}", str(t)) for i, t in enumerate(table.column("text").to_pylist())]
        except UnicodeDecodeError:
            raise ValueError(f"'{path}' is not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"'{path}' is not valid JSON lines (line {exc.lineno}: {exc.msg})") from None
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise ValueError(f"'{path}' cannot be read as {suffix[1:]} ({exc})") from None
    return docs


def _text_field(record, path: Path) -> str:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"'{path}' has a record without a string 'text' field")
    return record["text"]


def split_of(key: str) -> str:
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 20
    return "val" if bucket == 0 else "attack" if bucket == 1 else "train"


def read_domains(root: str) -> dict[str, list[tuple[str, str]]]:
    """domain → its documents, for a user folder of domain subfolders; one-line ValueErrors for what the
    run cannot use (also what `check_inputs` reads before a run exists)."""
    root_path = Path(root)
    folders = sorted(p for p in root_path.iterdir() if p.is_dir())
    if not [p for p in folders if p.name not in ("core", "unlabelled")]:
        raise ValueError(f"data '{root}' has no auxiliary domain folder besides core (and unlabelled)")
    texts = {p.name: _documents(p, root_path) for p in folders}
    for name, docs in texts.items():
        if not docs:
            raise ValueError(f"domain folder '{root_path / name}' holds no *.txt, *.jsonl or *.parquet document")
    return texts


class FolderCorpus(Corpus):
    """User domains. A domain without val (or attack) documents lends the tail of its train stream
    (5% each): a folder of a few files still works. val_heldout is val (user data has no entities)."""

    def __init__(self, root: str, context: int, val_windows: int, attack_windows: int, tokenizer: str | None):
        texts = read_domains(root)
        aux = [name for name in texts if name not in ("core", "unlabelled")]
        if tokenizer is not None:
            tok = HFTokenizer(tokenizer)
        else:
            chars = sorted({c for docs in texts.values() for _, text in docs for c in text} - {PAD})
            tok = CharTokenizer(PAD + "".join(chars), unk=True)
        super().__init__(tok, aux, context + 1, f"folder {root}", has_unlabelled="unlabelled" in texts)
        sep = getattr(tok, "sep", [])
        self._train: dict[str, torch.Tensor] = {}
        for name, docs in texts.items():
            streams = {"train": [], "val": [], "attack": []}
            for key, text in docs:
                streams[split_of(key)] += tok.encode(text) + sep
            n_train = len(streams["train"]) // self.length
            for split, share in (("val", val_windows), ("attack", attack_windows)):
                if len(streams[split]) < self.length and name != "unlabelled":
                    take = min(share, max(1, n_train // 20))
                    streams[split] = streams["train"][(n_train - take) * self.length:]
                    n_train -= take
            if n_train < 1:
                raise ValueError(f"domain '{name}' has less than one {self.length}-token training window; "
                                 "add text or lower gpt.context")
            self._train[name] = _cut(streams["train"], n_train, self.length)
            if name == "unlabelled":
                continue
            for split, count, target in (("val", val_windows, self.val), ("attack", attack_windows, self.attack)):
                n = min(count, len(streams[split]) // self.length)
                target[name] = _cut(streams[split], n, self.length)
        self.val_heldout = {name: self.val[name] for name in aux}
        self.attack.pop("core", None)
        self.val_topics = ["core"] * len(self.val["core"])

    def train(self, domain: str, n: int) -> torch.Tensor:
        pool = self._train[domain]
        reps = -(-n // len(pool))  # more than one epoch of a small domain: cycle it
        return pool.repeat(reps, 1)[:n]

    def pool_size(self, domain: str) -> int:
        return len(self._train[domain])


def build_corpus(cfg, seed: int) -> Corpus:
    from icml.methods.gradient_route.config import tokenizer_dir

    if cfg.data == "synthetic":
        return SyntheticCorpus(seed, cfg.gpt.context, cfg.val_windows, cfg.elicit.attack_windows, tokenizer_dir(cfg))
    return FolderCorpus(cfg.data, cfg.gpt.context, cfg.val_windows, cfg.elicit.attack_windows, tokenizer_dir(cfg))
