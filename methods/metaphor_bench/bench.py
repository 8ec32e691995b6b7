"""The procedural metaphor-video benchmark, written in the official layout, and its synthetic KG.

A hidden table maps each of 40 elements to 2–3 of 30 ideas (15 opposite pairs, so contradictions are
defined), each idea in a different dynamics class (0 decline, 1 closing-in, 2 rising). A video shows
an element with the dynamics of the meant idea's class, in one of the 8 metaphor types' styles, so
element + dynamics determine the idea. (element, idea) pairs are split 70/30: test_heldout videos'
core pairs never appear in training. The KG is external knowledge built from the table alone (all
pairs, literal attributes, distractor ideas, idea–idea links), never from golden sentences.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ELEMENTS = ["candle", "hourglass", "flower", "bird", "ladder", "cloud", "mask", "maze", "lighthouse", "clock",
            "tree", "bridge", "chain", "key", "door", "mirror", "river", "mountain", "seed", "feather", "anchor",
            "compass", "crown", "sword", "wall", "window", "butterfly", "wave", "sun", "moon", "storm", "road",
            "egg", "puppet", "balloon", "leaf", "stone", "fire", "rope", "shadow"]
IDEA_PAIRS = [("time-passing", "eternity"), ("mortality", "rebirth"), ("confinement", "freedom"),
              ("despair", "hope"), ("turmoil", "peace"), ("ambition", "contentment"), ("deception", "honesty"),
              ("isolation", "belonging"), ("fragility", "resilience"), ("decay", "growth"), ("fear", "courage"),
              ("loss", "gain"), ("conflict", "harmony"), ("chaos", "order"), ("pride", "humility")]
IDEAS = [idea for pair in IDEA_PAIRS for idea in pair]
OPPOSITE = {a: b for a, b in IDEA_PAIRS} | {b: a for a, b in IDEA_PAIRS}
IDEA_CLASS = {idea: i % 3 for i, idea in enumerate(IDEAS)}  # opposites (2k, 2k+1) never share a class
ATTRIBUTES = ["red", "blue", "green", "yellow", "round", "tall", "small", "bright", "dark", "heavy", "wooden",
              "metal", "soft", "sharp", "old", "shiny"]
TYPES = ["Body_Language", "Atmosphere_Language", "Cultural_Symbol", "Naturalistic_Symbol", "Causal_Montage",
         "Analogical_Montage", "Performative_Narrative", "Surreal_Narrative"]
NEUTRAL_TITLES = ["a short film", "watch this", "one minute", "untitled", "a quiet clip", "today"]
SHAPES = ["circle", "square", "triangle", "diamond", "cross", "bar", "ring", "star"]
COLOURS = [(220, 60, 50), (50, 110, 220), (60, 170, 80), (230, 190, 40), (160, 70, 190)]
EDGE_SENTENCES = ["Across folklore, {a} often calls {b} to mind.", "Poets have long tied {a} to {b}.",
                  "Many readers link {a} with {b}."]


def answer_sentence(element: str, idea: str) -> str:
    return f"The video presents the {element} content, implicitly expressing the {idea} idea"


@dataclass
class Table:
    ideas: dict[str, list[str]]  # element -> its ideas (each of a different class)
    attributes: dict[str, list[str]]
    distractors: dict[str, list[str]]
    heldout: set[tuple[str, str]]

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(e, i) for e in ELEMENTS for i in self.ideas[e]]

    def train_pairs(self) -> list[tuple[str, str]]:
        return [p for p in self.pairs if p not in self.heldout]


def make_table(seed: int, heldout_frac: float) -> Table:
    rng = np.random.default_rng([seed, 1])
    by_class = {c: [i for i in IDEAS if IDEA_CLASS[i] == c] for c in range(3)}
    ideas = {}
    for n, element in enumerate(ELEMENTS):
        classes = sorted(rng.choice(3, size=2 + int(rng.random() < 0.5), replace=False))
        # curated core: every idea once in element order, then seeded extras of the other classes
        core = IDEAS[n % len(IDEAS)]
        chosen = {IDEA_CLASS[core]: core}
        for c in classes:
            chosen.setdefault(int(c), by_class[int(c)][rng.integers(len(by_class[int(c)]))])
        ideas[element] = [chosen[c] for c in sorted(chosen)]
    attributes = {e: list(rng.choice(ATTRIBUTES, size=2, replace=False)) for e in ELEMENTS}
    distractors = {e: list(rng.choice([i for i in IDEAS if i not in ideas[e]], size=1 + int(rng.random() < 0.5),
                                      replace=False)) for e in ELEMENTS}
    table = Table(ideas, attributes, distractors, set())
    pairs = table.pairs
    order = rng.permutation(len(pairs))
    by_element = {e: len(ideas[e]) for e in ELEMENTS}
    by_idea = {i: sum(i in v for v in ideas.values()) for i in IDEAS}
    target = int(round(heldout_frac * len(pairs)))
    for j in order:  # hold a pair out only if its element and idea keep a training pair
        if len(table.heldout) >= target:
            break
        e, i = pairs[j]
        if by_element[e] > 1 and by_idea[i] > 1:
            table.heldout.add((e, i))
            by_element[e] -= 1
            by_idea[i] -= 1
    return table


# rendering -----------------------------------------------------------------------------------------------
def _icon(draw, element: str, cx: float, cy: float, r: float, shade: float = 1.0) -> None:
    n = ELEMENTS.index(element)
    shape, colour = SHAPES[n % len(SHAPES)], COLOURS[n // len(SHAPES)]
    fill = tuple(int(c * shade) for c in colour)
    box = [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    elif shape == "cross":
        draw.rectangle([cx - r / 3, cy - r, cx + r / 3, cy + r], fill=fill)
        draw.rectangle([cx - r, cy - r / 3, cx + r, cy + r / 3], fill=fill)
    elif shape == "bar":
        draw.rectangle([cx - r, cy - r / 3, cx + r, cy + r / 3], fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(r / 3)))
    else:
        draw.polygon([(cx + r * np.cos(a) * (1 if k % 2 == 0 else 0.45), cy + r * np.sin(a) * (1 if k % 2 == 0 else 0.45))
                      for k, a in enumerate(np.linspace(-np.pi / 2, 1.5 * np.pi, 10, endpoint=False))], fill=fill)


def _figure(draw, x: float, y: float, t: float, pose: int) -> None:
    """A stick figure; pose 0 slumps, 1 curls up, 2 raises its arms as t goes 0 → 1."""
    lean = [10 * t, 0, -4 * t][pose]
    draw.ellipse([x - 4 + lean, y - 20, x + 4 + lean, y - 12], outline=(20, 20, 20), width=2)
    draw.line([x + lean, y - 12, x, y + 4], fill=(20, 20, 20), width=2)
    arm = [(6, 6 + 8 * t), (6 - 4 * t, 2), (6, -10 * t)][pose]
    draw.line([x - arm[0], y - 6 + arm[1], x + lean / 2, y - 8, x + arm[0], y - 6 + arm[1]], fill=(20, 20, 20), width=2)
    draw.line([x - 5, y + 16, x, y + 4, x + 5, y + 16], fill=(20, 20, 20), width=2)


def render(kind: str, element: str, second: str | None, dyn: int, n_frames: int, size: int, rng) -> list:
    """n_frames PIL images: the element under the dynamics of class `dyn` in the type's style."""
    from PIL import Image, ImageDraw

    frames = []
    jitter = rng.uniform(-3, 3, size=2)
    for f in range(n_frames):
        t = f / max(1, n_frames - 1)
        base = 235
        if kind == "Atmosphere_Language":  # a global trend: darkening, greying, brightening
            base = int([235 - 150 * t, 200, 140 + 100 * t][dyn])
        image = Image.new("RGB", (size, size), (base, base, base if kind != "Naturalistic_Symbol" else base - 30))
        draw = ImageDraw.Draw(image)
        s = size / 96
        cx, cy = 48 * s + jitter[0], 48 * s + jitter[1]
        r = 16 * s
        shade = 1.0
        if dyn == 0:  # decline: shrinks and darkens
            r, shade = r * (1 - 0.5 * t), 1 - 0.5 * t
        elif dyn == 2:  # rising: climbs and grows
            cy, r = cy + 20 * s * (0.5 - t), r * (0.8 + 0.4 * t)
        shown = element
        if kind == "Causal_Montage" and second is not None and f >= n_frames // 2:
            shown = second  # shot A, then its consequence B
        if kind == "Analogical_Montage" and second is not None:
            _icon(draw, element, cx - 22 * s, cy, r * 0.7, shade)
            _icon(draw, second, cx + 22 * s, cy, r * 0.7, shade)
            draw.line([48 * s, 0, 48 * s, size], fill=(0, 0, 0), width=2)
        elif kind == "Surreal_Narrative":  # an impossible composition: the element floats in a second sky
            _icon(draw, shown, cx, cy, r, shade)
            _icon(draw, shown, cx - 30 * s, 14 * s, r * 0.4, shade)
            draw.line([0, 80 * s, size, 70 * s], fill=(90, 60, 200), width=3)
        else:
            _icon(draw, shown, cx + (18 * s if kind in ("Body_Language", "Performative_Narrative") else 0), cy, r, shade)
        if kind == "Body_Language":
            _figure(draw, 22 * s, 60 * s, t, dyn)
        elif kind == "Performative_Narrative":
            _figure(draw, (10 + 40 * t) * s, 64 * s, t, dyn)
        elif kind == "Cultural_Symbol":
            for k in range(0, size, int(12 * s)):
                draw.rectangle([k, 0, k + 5 * s, 5 * s], fill=(180, 30, 30))
                draw.rectangle([k, size - 5 * s, k + 5 * s, size], fill=(180, 30, 30))
        if dyn == 1:  # closing in: bars move towards the element
            gap = (40 - 26 * t) * s
            for x in (cx - gap, cx + gap):
                draw.rectangle([x - 2 * s, 8 * s, x + 2 * s, size - 8 * s], fill=(70, 70, 70))
        frames.append(image)
    return frames


# the benchmark -------------------------------------------------------------------------------------------
def _videos(table: Table, split: str, n: int, rng, allowed: list[tuple[str, str]]) -> list[dict]:
    out = []
    train = set(table.train_pairs())
    for k in range(n):
        element, idea = allowed[rng.integers(len(allowed))]
        kind = TYPES[rng.integers(len(TYPES))]
        pairs = [(element, idea)]
        second = None
        if kind in ("Causal_Montage", "Analogical_Montage"):
            # the second shot shares the dynamics class; in training only training pairs appear
            options = [(e, i) for (e, i) in table.pairs if e != element and IDEA_CLASS[i] == IDEA_CLASS[idea]
                       and (split != "train" or (e, i) in train)]
            if options:
                second_pair = options[rng.integers(len(options))]
                second = second_pair[0]
                pairs.append(second_pair)
        title = NEUTRAL_TITLES[rng.integers(len(NEUTRAL_TITLES))] if rng.random() < 0.5 else f"the {element} story"
        out.append({"video_id": f"{split}_{k:05d}", "split": split, "type": kind, "title": title, "pairs": pairs,
                    "dyn": IDEA_CLASS[idea], "second": second})
    return out


def generate(out: Path, seed: int, n_train: int, n_heldout: int, n_seen: int, heldout_frac: float,
             n_frames: int, size: int, embed_dim: int) -> Table:
    """OUT/train and OUT/test in the official layout (+ gold_ids.jsonl), OUT/kg/ the synthetic KGs."""
    from icml.methods.metaphor_bench.kg import HashEmbedder

    out = Path(out)
    table = make_table(seed, heldout_frac)
    rng = np.random.default_rng([seed, 2])
    held = sorted(table.heldout)
    splits = {"train": _videos(table, "train", n_train, rng, table.train_pairs()),
              "test": _videos(table, "test_heldout", n_heldout, rng, held)
              + _videos(table, "test_seen", n_seen, rng, table.train_pairs())}
    for folder, videos in splits.items():
        root = out / folder
        (root / "videos").mkdir(parents=True, exist_ok=True)
        with open(root / "datas.jsonl", "w", encoding="utf-8") as data, open(root / "gold_ids.jsonl", "w") as gold:
            for video in videos:
                frames_dir = root / "videos" / video["video_id"]
                frames_dir.mkdir(exist_ok=True)
                for f, image in enumerate(render(video["type"], video["pairs"][0][0], video["second"], video["dyn"],
                                                 n_frames, size, rng), 1):
                    image.save(frames_dir / f"frame_{f:06d}.jpg", quality=90)
                answers = [answer_sentence(e, i) for e, i in video["pairs"]]
                data.write(json.dumps({"video_id": video["video_id"], "title": video["title"],
                                       "golden_answers": answers, "metaphor_type": [video["type"]]}) + "\n")
                gold.write(json.dumps({"video_id": video["video_id"], "split": video["split"], "pairs": video["pairs"],
                                       "elements": [e for e, _ in video["pairs"]], "dyn": video["dyn"]}) + "\n")
    kg = build_kg(table, HashEmbedder(embed_dim))
    (out / "kg").mkdir(parents=True, exist_ok=True)
    kg.save(out / "kg" / "metaphor_graph.json", out / "kg" / "metaphor_graph_embedding_word.pt")
    kg.permuted(seed).save(out / "kg" / "metaphor_graph_random.json", out / "kg" / "metaphor_graph_random_embedding_word.pt")
    return table


def build_kg(table: Table, embed):
    """The synthetic KG in the official schema, from the hidden table only (train and held-out pairs alike)."""
    from icml.methods.metaphor_bench.kg import KnowledgeGraph

    words = ELEMENTS + [e + "s" for e in ELEMENTS] + IDEAS + ATTRIBUTES
    graph = {str(i): {"word": w, "adjacency": {}} for i, w in enumerate(words)}
    node = {w: graph[str(i)] for i, w in enumerate(words)}

    def edge(a, b, k):
        node[a]["adjacency"][b] = {"sentences": [EDGE_SENTENCES[k % len(EDGE_SENTENCES)].format(a=a, b=b)]}

    for n, element in enumerate(ELEMENTS):
        for k, idea in enumerate(table.ideas[element] + table.distractors[element]):
            edge(element, idea, n + k)
        for k, attribute in enumerate(table.attributes[element]):
            edge(element, attribute, n + k + 1)
        edge(element + "s", element, n)  # a synonym (plural) reaches the ideas in two hops
    for n, idea in enumerate(IDEAS):
        same = [i for i in IDEAS if IDEA_CLASS[i] == IDEA_CLASS[idea] and i != idea]
        for k in range(1 + n % 2):
            edge(idea, same[(n + k) % len(same)], n)
    return KnowledgeGraph(graph, embed(words))
