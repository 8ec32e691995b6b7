"""Long-context tasks in natural text for a real chat model (`--preset real`).

Every example is built from a seed, with no file: the filler is English sentences composed from the word
lists below (a small grammar of people, actions, places and times; no digit and no city name), and the facts to find are sentences of the same kind placed at known depths. The prompt is one user
turn in the model's own chat format (`tokenizer.apply_chat_template`), the question at its end, so that it
lies in the observation window of question-aware compression.

Tasks (`REAL_TASKS`; the context length is counted in the model's tokens):
- `passkey` (~1.5k tokens) and `passkey_long` (~4k): one pass key (5 digits) at the depth
  `DEPTHS[example_id % len(DEPTHS)]`; the question asks for it.
- `multikey` (~1.5k): `multikey_needles` "special magic numbers", one per city, at evenly spaced depths in a
  random order; one of them is asked, in turn the first, second, … needle of the context.
- `aggregation` (~1.5k): `aggregation_facts` special magic numbers (RULER's multi-value needle) at evenly
  spaced depths; the question asks for all of them, so the answer needs every scattered fact (references:
  the numbers in any order, joined by commas or with "and" before the last).

The assistant's turn opens with an answer prefix ("The pass key is", as RULER does), so that a chat model's
answer is the value itself and exact match is meaningful; the prompt is the template's text plus that prefix.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Callable

REAL_TASKS = ("passkey", "passkey_long", "multikey", "aggregation")
COUNTS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # the passkey's depth cycles through these, example by example

SUBJECTS = ["the old farmer", "a young teacher", "the tired baker", "my neighbour", "the quiet librarian",
            "a curious child", "the village doctor", "the night guard", "an old fisherman", "the new student",
            "the shop owner", "a travelling musician", "the gardener", "the ship's captain", "a retired painter",
            "the postman", "the young engineer", "her grandmother", "the mayor", "a lonely poet", "the carpenter",
            "a group of hikers", "the school choir", "the blacksmith", "a shy waiter", "the bus driver",
            "the head nurse", "an elderly couple", "the miller", "a street vendor"]
ACTIONS = ["repaired the wooden fence", "carried a basket of apples", "painted the front door",
           "read an old newspaper", "planted tomatoes in the garden", "cleaned the kitchen window",
           "fed the hungry cats", "wrote a long letter", "baked fresh bread", "counted the empty boxes",
           "sang a quiet song", "walked the dog", "fixed the broken clock", "swept the dusty floor",
           "watched the boats", "lit a small fire", "tied up the boat", "sorted the mail", "folded the laundry",
           "climbed the hill", "picked wild berries", "mended a torn coat", "chopped firewood",
           "washed the old cart", "hung lanterns on the wall", "tuned the piano", "gathered fallen leaves",
           "brewed a pot of tea", "polished the silver spoons", "fixed the leaking roof"]
PLACES = ["near the river", "behind the station", "in the market square", "by the old bridge",
          "at the edge of the forest", "in the small kitchen", "on the hill", "beside the lake", "in the library",
          "at the harbour", "under the oak tree", "in the town hall", "outside the bakery", "in the courtyard",
          "along the canal", "at the crossroads", "in the orchard", "on the village green", "inside the barn",
          "by the church"]
TIMES = ["in the morning", "after lunch", "before sunset", "on a rainy day", "late at night", "every Sunday",
         "in early spring", "during the winter", "at noon", "on the first day of summer", "in the evening",
         "at dawn", "on a windy afternoon", "after the harvest", "before the storm"]
THINGS = ["road", "water", "garden", "sky", "market", "room", "path", "wind", "bread", "music"]
QUALITIES = ["quiet", "cold", "bright", "busy", "calm", "warm", "grey", "sweet", "loud", "clear"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Dublin", "Vienna", "Prague", "Madrid", "Athens", "Warsaw",
          "Helsinki", "Nairobi", "Santiago", "Bogota", "Havana", "Manila", "Hanoi", "Seoul", "Bangkok", "Jakarta",
          "Ottawa", "Montreal", "Sydney", "Auckland", "Reykjavik", "Budapest", "Bucharest", "Sofia", "Zagreb",
          "Tunis", "Dakar", "Accra", "Quito", "Caracas", "Denver", "Boston", "Chicago", "Seattle", "Geneva",
          "Munich"]
INTRO = {"passkey": "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize "
                    "it. I will quiz you about the pass key.",
         "multikey": "Some special magic numbers are hidden inside a lot of irrelevant text. Find them and "
                     "memorize them. I will quiz you about one of them.",
         "aggregation": "Some special magic numbers are hidden inside a lot of irrelevant text. Find them and "
                        "memorize them. I will quiz you about them."}


@dataclass(frozen=True)
class RealExample:
    task: str
    example_id: int
    intro: str
    context: str  # the long text, facts included
    question: str
    answers: tuple[str, ...]  # references: token F1 and exact match keep the best; the first is canonical
    items: tuple[str, ...]  # what the answer needs (the key, the asked number, each city): item_recall
    needles: tuple[str, ...]  # the fact sentences, in the order of the text
    depths: tuple[float, ...]  # each needle's depth: the share of the context's filler sentences before it
    asked: tuple[int, ...]  # the needles the question asks about (indices into needles)
    answer_prefix: str = ""  # the start of the assistant's turn, given (RULER's answer prefix)

    @property
    def answer(self) -> str:
        return self.answers[0]

    def user_message(self) -> str:
        return f"{self.intro}\n\n{self.context}\n\n{self.question}"


def prompt_text(tokenizer, example: RealExample) -> str:
    """One user turn in the tokenizer's chat format, then the assistant's turn opened with the answer prefix."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: --preset real asks a chat (instruct) model")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": example.user_message()}],
                                         add_generation_prompt=True, tokenize=False)
    return chat + example.answer_prefix


def prompt_ids(tokenizer, example: RealExample) -> list[int]:
    """The token ids of `prompt_text` (the template's special tokens as the template writes them)."""
    return [int(i) for i in tokenizer(prompt_text(tokenizer, example), add_special_tokens=False)["input_ids"]]


def filler_sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    subject, action, place, time = (rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(PLACES),
                                    rng.choice(TIMES))
    if kind == 0:
        text = f"{time}, {subject} {action} {place}."
    elif kind == 1:
        text = f"{subject} {action} {place} {time}."
    elif kind == 2:
        text = f"the {rng.choice(THINGS)} {place} was {rng.choice(QUALITIES)} {time}."
    else:
        text = f"nobody knew why {subject} {action} {place}."
    return text[0].upper() + text[1:]


def _filler(rng: random.Random, budget: int, count: Callable[[str], int], minimum: int = 2) -> list[str]:
    """Filler sentences until their tokens (each counted with its leading space) reach `budget`, and at least
    `minimum` of them."""
    sentences, used = [], 0
    while used < budget or len(sentences) < minimum:
        sentence = filler_sentence(rng)
        sentences.append(sentence)
        used += count(" " + sentence)
    return sentences


def _place(sentences: list[str], needles: list[str], depths: list[float]) -> tuple[str, tuple[float, ...]]:
    """Insert each needle after round(depth × len(sentences)) filler sentences (needles in depth order);
    returns the text and each needle's realised depth (filler sentences before it ÷ all filler sentences)."""
    order = sorted(range(len(needles)), key=lambda i: depths[i])
    slots = [min(len(sentences), max(0, round(depths[i] * len(sentences)))) for i in order]
    out, start, realised = [], 0, {}
    for i, slot in zip(order, slots):
        out += sentences[start:slot] + [needles[i]]
        start = slot
        realised[i] = slot / len(sentences)
    out += sentences[start:]
    return " ".join(out), tuple(realised[i] for i in range(len(needles)))


def _spread(rng: random.Random, n: int, low: float = 0.05, high: float = 0.95) -> list[float]:
    """n depths evenly spaced in [low, high] with a small jitter, in a random order."""
    step = (high - low) / n
    depths = [low + step * (k + 0.5) + rng.uniform(-0.25, 0.25) * step for k in range(n)]
    rng.shuffle(depths)
    return depths


def _number(rng: random.Random, taken: set[str]) -> str:
    while (value := str(rng.randint(10000, 99999))) in taken:
        pass
    taken.add(value)
    return value


def generate_real(task: str, example_id: int, rng: random.Random, count: Callable[[str], int], tokens: int,
                  n_needles: int = 4, n_facts: int = 3) -> RealExample:
    """One example whose context holds about `tokens` tokens (counted by `count`)."""
    if task in ("passkey", "passkey_long"):
        key = _number(rng, set())
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        depth = DEPTHS[example_id % len(DEPTHS)]
        sentences = _filler(rng, tokens - count(" " + needle), count)
        context, depths = _place(sentences, [needle], [depth])
        return RealExample(task, example_id, INTRO["passkey"], context,
                           "What is the pass key? Answer with the pass key only.", (key,), (key,), (needle,),
                           depths, (0,), "The pass key is")
    if task == "multikey":
        cities, taken = rng.sample(CITIES, n_needles), set()
        values = [_number(rng, taken) for _ in cities]
        needles = [f"The special magic number for {city} is {value}." for city, value in zip(cities, values)]
        sentences = _filler(rng, tokens - sum(count(" " + n) for n in needles), count, len(needles) + 1)
        context, depths = _place(sentences, needles, _spread(rng, n_needles))
        by_depth = sorted(range(n_needles), key=lambda i: depths[i])
        asked = by_depth[example_id % n_needles]  # the first, second, … needle of the text in turn
        return _in_text_order(RealExample(
            task, example_id, INTRO["multikey"], context,
            f"What is the special magic number for {cities[asked]}? Answer with the number only.",
            (values[asked],), (values[asked],), tuple(needles), depths, (asked,),
            f"The special magic number for {cities[asked]} is"))
    if task == "aggregation":
        taken = set()
        values = [_number(rng, taken) for _ in range(n_facts)]
        needles = [f"One of the special magic numbers is {value}." for value in values]
        sentences = _filler(rng, tokens - sum(count(" " + n) for n in needles), count, len(needles) + 1)
        context, depths = _place(sentences, needles, _spread(rng, n_facts))
        ordered = [values[i] for i in sorted(range(n_facts), key=lambda i: depths[i])]
        return _in_text_order(RealExample(
            task, example_id, INTRO["aggregation"], context,
            f"What are the {COUNTS[n_facts]} special magic numbers mentioned in the text? Answer with the numbers "
            "only.", _any_order(ordered), tuple(ordered), tuple(needles), depths, tuple(range(n_facts)),
            f"The {COUNTS[n_facts]} special magic numbers mentioned in the text are"))
    raise ValueError(f"unknown real task '{task}'; valid: {', '.join(REAL_TASKS)}")


def _any_order(items: list[str]) -> tuple[str, ...]:
    """References for a list answer: the items in every order, joined by commas or with "and" before the last
    (the normalisation drops the commas); the order of the text first."""
    out = []
    for order in itertools.permutations(items):
        out += [", ".join(order), ", ".join(order[:-1]) + " and " + order[-1]]
    return tuple(dict.fromkeys(out))


def _in_text_order(example: RealExample) -> RealExample:
    """needles, depths and asked re-indexed in the order of the text."""
    order = sorted(range(len(example.needles)), key=lambda i: example.depths[i])
    where = {old: new for new, old in enumerate(order)}
    return RealExample(example.task, example.example_id, example.intro, example.context, example.question,
                       example.answers, example.items, tuple(example.needles[i] for i in order),
                       tuple(example.depths[i] for i in order), tuple(sorted(where[i] for i in example.asked)),
                       example.answer_prefix)


def token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def real_set(tasks: list[str], n_per_task: int, seed: int, stream: str, count: Callable[[str], int],
             lengths: dict[str, int], n_needles: int = 4, n_facts: int = 3) -> list[RealExample]:
    """Deterministic from (seed, stream, task) and the tokenizer behind `count`: the calibration and test streams
    never share an example; each task draws from its own generator, so the tasks chosen change no other's."""
    out = []
    for task in tasks:
        rng = random.Random(f"{seed}/{stream}/{task}")
        out += [generate_real(task, i, rng, count, lengths[task], n_needles, n_facts)
                for i in range(n_per_task)]
    return out
