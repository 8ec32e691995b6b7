"""MetaphorBoost retrieval on a fixture KG (argmax node, adjacency counts, hop-2 BFS counting, top-k
tie order, formatting and truncation), the hashing embedder, and the procedural benchmark's
held-out split and leakage-free KG."""
from __future__ import annotations

import json

import pytest
import torch

from icml.methods.metaphor_bench import bench
from icml.methods.metaphor_bench.kg import (MAX_REFERENCE_CHARS, TRUNCATION_SUFFIX, HashEmbedder, KnowledgeGraph,
                                            format_reference, oracle_reference)


def _fixture():
    adj = lambda *ws: {w: {"sentences": [f"s-{w}", "shared"]} for w in ws}
    graph = {"0": {"word": "candle", "adjacency": adj("mortality", "hope", "wax")},
             "1": {"word": "mortality", "adjacency": adj("decay", "hope")},
             "2": {"word": "hope", "adjacency": adj("decay")},
             "3": {"word": "decay", "adjacency": {}},
             "4": {"word": "clock", "adjacency": adj("hope", "mortality")}}
    emb = torch.eye(5)
    return KnowledgeGraph(graph, emb)


def test_one_hop_counts_sources_and_tie_order():
    kg = _fixture()
    top = kg.retrieve(["q1", "q2"], [0, 4], top_k=10, num_hops=1)
    # candle: mortality, hope, wax; clock: hope, mortality → counts 2, 2, 1; ties keep first insertion
    assert [(w, c) for w, c, _ in top] == [("mortality", 2), ("hope", 2), ("wax", 1)]
    assert top[0][2]["source_words"] == ["q1", "q2"] and top[0][2]["sentences"] == ["s-mortality", "shared"]
    assert [w for w, _, _ in kg.retrieve(["q1", "q2"], [0, 4], top_k=2, num_hops=1)] == ["mortality", "hope"]
    assert kg.retrieve(["q1"], [0], top_k=0, num_hops=1) == [] and format_reference([]) == ""


def test_two_hop_bfs_counts_every_expansion():
    kg = _fixture()
    top = dict((w, (c, info)) for w, c, info in kg.retrieve(["q"], [0], top_k=10, num_hops=2))
    # hop 0 expands candle: mortality, hope, wax (+1 each); hop 1 expands mortality (decay, hope) and
    # hope (decay); wax has no node. hope is counted again although already seen; decay twice.
    assert {w: c for w, (c, _) in top.items()} == {"mortality": 1, "hope": 2, "wax": 1, "decay": 2}
    assert top["decay"][1]["min_hop"] == 2 and top["hope"][1]["min_hop"] == 1
    assert top["decay"][1]["source_words"] == ["q", "q"]
    # three hops: decay (visited at hop 2) expands to nothing; counts unchanged
    assert {w: c for w, c, _ in kg.retrieve(["q"], [0], 10, 3)} == {"mortality": 1, "hope": 2, "wax": 1, "decay": 2}


def test_argmax_uses_the_stored_matrix_without_renormalising():
    kg = _fixture()
    embed = lambda texts: torch.tensor([[1.0, 0.9, 0, 0, 0]] * len(texts))
    assert kg.nodes_for(["x"], embed) == [0]
    scaled = KnowledgeGraph(kg.graph, torch.diag(torch.tensor([1.0, 2.0, 1, 1, 1])))
    assert scaled.nodes_for(["x"], embed) == [1]  # a renormalised matrix would still pick node 0
    tie = lambda texts: torch.tensor([[1.0, 1.0, 0, 0, 0]] * len(texts))
    assert kg.nodes_for(["x"], tie) == [0]  # first index on ties


def test_reference_format_and_truncation():
    top = [("hope", 2, {"source_words": ["b", "a", "b"], "sentences": ["line\none ", "two"]})]
    assert format_reference(top) == '• The concept "b", "a" is possiblely associated with "hope"'
    assert format_reference(top, "examples") == ('• The concept "b", "a" is possiblely associated with "hope"'
                                                 "\n  Example usage:\n    1. line one")
    line = [(f"w{i:04d}", 1, {"source_words": ["q"], "sentences": []}) for i in range(200)]
    full = "\n".join(f'• The concept "q" is possiblely associated with "w{i:04d}"' for i in range(200))
    out = format_reference(line)
    assert len(full) > MAX_REFERENCE_CHARS and out == full[:MAX_REFERENCE_CHARS] + TRUNCATION_SUFFIX
    # the boundary: exactly 4000 characters is kept whole, 4001 is cut to 4000 + the suffix
    frame = len('• The concept "q" is possiblely associated with ""')
    exact = format_reference([("x" * (MAX_REFERENCE_CHARS - frame), 1, {"source_words": ["q"], "sentences": []})])
    assert len(exact) == MAX_REFERENCE_CHARS and not exact.endswith(TRUNCATION_SUFFIX)
    over = format_reference([("x" * (MAX_REFERENCE_CHARS - frame + 1), 1, {"source_words": ["q"], "sentences": []})])
    assert len(over) == MAX_REFERENCE_CHARS + len(TRUNCATION_SUFFIX) and over.endswith('x' + TRUNCATION_SUFFIX)
    assert oracle_reference([("candle", "mortality")]) == '• The concept "candle" is possiblely associated with "mortality"'


def test_hash_embedder_is_unit_norm_and_deterministic():
    a, b = HashEmbedder(512)(["candle", "the candle burns"]), HashEmbedder(512)(["candle", "the candle burns"])
    assert torch.equal(a, b)
    # float32 norm of a normalised vector: within a few ulps of 1 (sum of D squares, D = 512)
    torch.testing.assert_close(a.norm(dim=1), torch.ones(2), atol=8 * torch.finfo(torch.float32).eps, rtol=0)
    assert float(a[0] @ a[1]) > 0.3 and float(a[0] @ HashEmbedder(512)(["storm"])[0]) < float(a[0] @ a[1])


def test_permuted_kg_keeps_nodes_and_the_multiset_of_adjacencies():
    kg = _fixture()
    rand = kg.permuted(3)
    assert [n["word"] for n in rand.graph.values()] == [n["word"] for n in kg.graph.values()]
    key = lambda g: sorted(json.dumps(n["adjacency"], sort_keys=True) for n in g.values())
    assert key(rand.graph) == key(kg.graph) and rand.embeddings is kg.embeddings


def test_heldout_split_and_no_leakage(tmp_path):
    table = bench.generate(tmp_path, 5, 12, 6, 4, 0.3, 2, 32, 256)
    train_pairs = set(table.train_pairs())
    assert table.heldout and not table.heldout & train_pairs
    assert {e for e, _ in train_pairs} == set(bench.ELEMENTS) and {i for _, i in train_pairs} == set(bench.IDEAS)
    gold = [json.loads(l) for l in (tmp_path / "test" / "gold_ids.jsonl").read_text().splitlines()]
    assert all(tuple(g["pairs"][0]) in table.heldout for g in gold if g["split"] == "test_heldout")
    assert all(tuple(g["pairs"][0]) in train_pairs for g in gold if g["split"] == "test_seen")
    train_gold = [json.loads(l) for l in (tmp_path / "train" / "gold_ids.jsonl").read_text().splitlines()]
    assert all(tuple(p) in train_pairs for g in train_gold for p in g["pairs"])
    # the KG: every true mapping (held-out too), and no golden sentence or golden template text
    kg = KnowledgeGraph.load(tmp_path / "kg" / "metaphor_graph.json", tmp_path / "kg" / "metaphor_graph_embedding_word.pt")
    node = {n["word"]: n for n in kg.graph.values()}
    assert all(i in node[e]["adjacency"] for e, i in table.pairs)
    text = (tmp_path / "kg" / "metaphor_graph.json").read_text()
    answers = [a for l in (tmp_path / "test" / "datas.jsonl").read_text().splitlines() for a in json.loads(l)["golden_answers"]]
    assert answers and not any(a in text for a in answers)
    assert "implicitly expressing" not in text and "The video presents" not in text
    # built from the table alone: the same graph whatever videos were drawn
    again = bench.build_kg(bench.make_table(5, 0.3), HashEmbedder(256))
    assert again.graph == kg.graph and torch.equal(again.embeddings, kg.embeddings)
    frames = sorted((tmp_path / "test" / "videos" / gold[0]["video_id"]).iterdir())
    assert [f.name for f in frames] == ["frame_000001.jpg", "frame_000002.jpg"]
