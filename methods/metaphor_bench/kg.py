"""MetaphorBoost retrieval over a metaphor KG in the official schema.

Graph: {"<id>": {"word": w, "adjacency": {adj_word: {"sentences": […]}}}} with a float tensor [N, D]
whose row i embeds node "i". A query is embedded as QUERY_TEMPLATE.format(q), L2-normalised, and
scored by a dot product with the stored (not renormalised) node matrix; its node is the argmax.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from icml.cli.errors import UsageError
from icml.methods.metaphor_bench.protocol import QUERY_TEMPLATE

MAX_REFERENCE_CHARS = 4000
TRUNCATION_SUFFIX = "\n... (more associations omitted)"


# embeddings ----------------------------------------------------------------------------------------------
class HashEmbedder:
    """Signed char-3-gram hashing (stable md5 hash, '#'-padded words), L2-normalised."""

    def __init__(self, dim: int = 4096):
        self.dim = dim

    def _vector(self, text: str) -> np.ndarray:
        v = np.zeros(self.dim)
        for word in text.lower().split():
            padded = f"#{word}#"
            for i in range(len(padded) - 2):
                h = int.from_bytes(hashlib.md5(padded[i:i + 3].encode()).digest()[:8], "little")
                v[h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        norm = np.linalg.norm(v)
        return v / norm if norm > 0 else v

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor(np.stack([self._vector(t) for t in texts]), dtype=torch.float32)


class HFEmbedder:
    """A local HF encoder: masked mean of the last hidden state, L2-normalised."""

    def __init__(self, path: str):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)
        return torch.nn.functional.normalize(pooled, dim=-1).float()


# the graph -----------------------------------------------------------------------------------------------
@dataclass
class KnowledgeGraph:
    graph: dict  # the official JSON
    embeddings: torch.Tensor  # [N, D], row i = node "i"

    def __post_init__(self):
        self.word_to_idx = {}
        for key, node in self.graph.items():  # later duplicates win, as in the official dict comprehension
            self.word_to_idx[node["word"]] = int(key)
        if self.embeddings.shape[0] != len(self.graph):
            raise UsageError(f"KG has {len(self.graph)} nodes but its embedding matrix has "
                             f"{self.embeddings.shape[0]} rows", "pass the .pt written with this graph")

    @classmethod
    def load(cls, json_path: Path, emb_path: Path) -> "KnowledgeGraph":
        try:
            graph = json.loads(Path(json_path).read_text(encoding="utf-8"))
            assert isinstance(graph, dict) and all("word" in n for n in graph.values())
        except (ValueError, AssertionError, AttributeError):
            raise UsageError(f"KG file '{json_path}' is not a graph in the official schema",
                             'expected {"<id>": {"word": w, "adjacency": {adj: {"sentences": [...]}}}}') from None
        try:
            emb = torch.load(emb_path, map_location="cpu", weights_only=True)
            assert isinstance(emb, torch.Tensor) and emb.ndim == 2
        except Exception:
            raise UsageError(f"KG embeddings '{emb_path}' are not a 2-D float tensor saved with torch.save",
                             "pass the metaphor_graph_embedding_word.pt that goes with the graph") from None
        return cls(graph, emb.float())

    def save(self, json_path: Path, emb_path: Path) -> None:
        Path(json_path).write_text(json.dumps(self.graph, ensure_ascii=False), encoding="utf-8")
        torch.save(self.embeddings, emb_path)

    def nodes_for(self, queries: list[str], embed) -> list[int]:
        """The argmax node of each query (torch.argmax: the first index on ties)."""
        if not queries:
            return []
        q = embed([QUERY_TEMPLATE.format(x) for x in queries])
        q = torch.nn.functional.normalize(q.float(), dim=-1)
        return (q @ self.embeddings.T).argmax(dim=1).tolist()

    def retrieve(self, queries: list[str], nodes: list[int], top_k: int, num_hops: int) -> list[tuple[str, int, dict]]:
        """(adjacency word, count, {source_words, sentences[, min_hop]}) for the top_k counts; ties
        keep first insertion (Counter.most_common is a stable sort)."""
        counter, info = Counter(), {}

        def visit(adj_word, adj, source, hop):
            counter[adj_word] += 1
            entry = info.setdefault(adj_word, {"source_words": [], "sentences": [], "min_hop": hop})
            entry["source_words"].append(source)
            entry["min_hop"] = min(entry["min_hop"], hop)
            for sentence in adj.get("sentences", []):
                if sentence not in entry["sentences"]:
                    entry["sentences"].append(sentence)

        for query, start in zip(queries, nodes):
            if num_hops <= 1:
                for adj_word, adj in self.graph[str(start)].get("adjacency", {}).items():
                    visit(adj_word, adj, query, 1)
                continue
            visited, queue = {start: 0}, [(start, 0)]
            while queue:  # FIFO BFS; every expansion counts every adjacency word again
                current, hop = queue.pop(0)
                if hop >= num_hops:
                    continue
                for adj_word, adj in self.graph[str(current)].get("adjacency", {}).items():
                    visit(adj_word, adj, query, hop + 1)
                    nxt = self.word_to_idx.get(adj_word)
                    if nxt is not None and nxt not in visited:
                        visited[nxt] = hop + 1
                        queue.append((nxt, hop + 1))
        if num_hops <= 1:
            for entry in info.values():
                entry.pop("min_hop")
        return [(word, count, info[word]) for word, count in counter.most_common(top_k)] if top_k > 0 else []

    def permuted(self, seed: int) -> "KnowledgeGraph":
        """The random KG: the same nodes and embeddings, adjacency dicts permuted across nodes."""
        keys = list(self.graph)
        order = np.random.default_rng(seed).permutation(len(keys))
        graph = {k: {"word": self.graph[k]["word"], "adjacency": self.graph[keys[j]].get("adjacency", {})}
                 for k, j in zip(keys, order)}
        return KnowledgeGraph(graph, self.embeddings)


def unique_in_order(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def format_reference(top: list[tuple[str, int, dict]], mode: str = "simple") -> str:
    """The official reference block ('possiblely' verbatim), truncated to 4000 chars + a suffix.
    Sources are the unique source queries in first-occurrence order (the official set() is unordered)."""
    if not top:
        return ""
    parts = []
    for adj_word, _, entry in top:
        sources = ", ".join(f'"{w}"' for w in unique_in_order(entry["source_words"]))
        line = f'• The concept {sources} is possiblely associated with "{adj_word}"'
        if mode == "examples" and entry["sentences"]:
            line += "\n  Example usage:" + f"\n    1. {entry['sentences'][0].replace(chr(10), ' ').strip()}"
        parts.append(line)
    text = "\n".join(parts)
    return text[:MAX_REFERENCE_CHARS] + TRUNCATION_SUFFIX if len(text) > MAX_REFERENCE_CHARS else text


def oracle_reference(pairs: list[tuple[str, str]]) -> str:
    """Exactly the gold element→idea mappings, in the simple format."""
    return format_reference([(idea, 1, {"source_words": [element], "sentences": []}) for element, idea in pairs])
