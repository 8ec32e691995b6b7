"""The topic-story corpus (seeded, one alphabet, disjoint attack and held-out facts) and the loader
of user text domains."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from icml.methods.gradient_route.data import (ALPHABET, ATTACK_ENTITIES, HELDOUT_ENTITIES, TOPICS, FolderCorpus,
                                              SyntheticCorpus, build_world, split_of, story)


def test_world_names_are_unique_across_topics_and_built_from_shared_syllables():
    world = build_world(0)
    words = world.names + [w for t in TOPICS for w in world.entities[t] + world.objects[t]]
    assert len({w.lower() for w in words}) == len(words) == 20 + 12 * (40 + 20)
    syllable = re.compile(r"^(?:[bdfgklmnprstvz][aeiou][nrl]?)+$")
    assert all(syllable.match(w.lower()) for w in words)
    assert build_world(0) == world and build_world(1) != world  # a function of the seed only


def test_stories_are_seeded_and_use_the_fixed_alphabet():
    world = build_world(0)
    text = story(world, 0, "train", "a0", 5)
    assert text == story(world, 0, "train", "a0", 5) and text != story(world, 0, "train", "a0", 6)
    assert text.endswith("\n") and set(text) <= set(ALPHABET)
    assert 6 <= text.count(".") <= 10


def test_attack_and_heldout_facts_are_disjoint_entities():
    world = build_world(0)
    names = world.entities["a1"]
    attack = "".join(story(world, 0, "attack", "a1", i) for i in range(60))
    heldout = "".join(story(world, 0, "val_heldout", "a1", i) for i in range(60))
    seen = {i for i, n in enumerate(names) if re.search(rf"\b{n}\b", attack)}
    unseen = {i for i, n in enumerate(names) if re.search(rf"\b{n}\b", heldout)}
    assert seen <= set(ATTACK_ENTITIES) and unseen <= set(HELDOUT_ENTITIES) and seen and unseen
    facts = {names[e]: world.objects["a1"][world.facts["a1"][e]] for e in range(40)}
    for sentence in re.findall(r"([A-Z][a-z]+) keeps the ([a-z]+)\.", heldout):
        if sentence[0] in facts:
            assert facts[sentence[0]] == sentence[1]  # a fact is always the same fact


def test_corpus_windows_are_prefix_stable_and_balanced():
    corpus = SyntheticCorpus(0, 31, 16, 4)
    assert corpus.vocab_size == len(ALPHABET) == 57 and corpus.length == 32
    assert torch.equal(corpus.train("core", 40)[:24], corpus.train("core", 24))
    assert torch.equal(corpus.train("a2", 10), SyntheticCorpus(0, 31, 16, 4).train("a2", 10))
    assert corpus.val_topics == [t for t in TOPICS[:8] for _ in range(2)]
    assert corpus.val["core"].shape == (16, 32) and corpus.attack["a0"].shape == (4, 32)
    assert set(corpus.val_heldout) == {"a0", "a1", "a2", "a3"}


def test_select_windows_are_held_apart_from_every_other_split():
    corpus = SyntheticCorpus(0, 31, 16, 4)
    assert set(corpus.select) == set(corpus.val) == {"core", "a0", "a1", "a2", "a3"}
    assert all(corpus.select[d].shape == corpus.val[d].shape for d in corpus.val)
    assert torch.equal(corpus.select["a1"], corpus.windows("select", "a1", 16))  # its own seeded stream
    text = {split: {corpus.tokenizer.decode(w.tolist()) for w in windows}
            for split, windows in (("select", corpus.select["a1"]), ("val", corpus.val["a1"]),
                                   ("val_heldout", corpus.val_heldout["a1"]), ("attack", corpus.attack["a1"]),
                                   ("train", corpus.train("a1", 64)))}
    assert all(not text["select"] & text[split] for split in text if split != "select")


def _folder(tmp_path):
    root = tmp_path / "domains"
    for name in ("core", "bio", "chem"):
        (root / name).mkdir(parents=True)
    for i in range(12):
        (root / "core" / f"doc{i}.txt").write_text(f"the core text number {i} is plain. " * 20)
    (root / "bio" / "cells.jsonl").write_text("\n".join(json.dumps({"text": f"cells divide {i} times. " * 8})
                                                        for i in range(40)))
    pq.write_table(pa.table({"text": [f"acids react {i} ways. " * 8 for i in range(40)]}), root / "chem" / "a.parquet")
    return root


def test_folder_corpus_splits_by_hash_and_reads_every_format(tmp_path):
    root = _folder(tmp_path)
    corpus = FolderCorpus(str(root), 31, 4, 2, None)
    assert corpus.domains == ["core", "bio", "chem"] and not corpus.has_unlabelled
    assert corpus.tokenizer.decode(corpus.train("bio", 1)[0].tolist()).startswith("cells divide 0")
    assert all(len(corpus.val[d]) >= 1 for d in corpus.domains) and set(corpus.attack) == {"bio", "chem"}
    assert corpus.pool_size("chem") > 0 and len(corpus.train("chem", 3 * corpus.pool_size("chem"))) > 0
    assert split_of("bio/cells.jsonl:0") == split_of("bio/cells.jsonl:0")
    buckets = [split_of(f"x/{i}.txt") for i in range(2000)]
    assert 0.03 < buckets.count("val") / 2000 < 0.07 and 0.03 < buckets.count("attack") / 2000 < 0.07
    assert corpus.tokenizer.encode("€")[0] == corpus.tokenizer.unk_id  # unseen characters → <unk>


def test_folder_corpus_bad_files_are_one_line_errors(tmp_path):
    root = _folder(tmp_path)
    (root / "bio" / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="not valid JSON lines"):
        FolderCorpus(str(root), 31, 4, 2, None)
    (root / "bio" / "broken.jsonl").write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match="without a string 'text' field"):
        FolderCorpus(str(root), 31, 4, 2, None)
    (root / "bio" / "broken.jsonl").unlink()
    (root / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        FolderCorpus(str(root), 31, 4, 2, None)
