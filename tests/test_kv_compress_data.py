"""kv-compress data: generated answers are correct, generation is deterministic, user JSONL
files load in both schemas and malformed ones fail with one clear error."""
from __future__ import annotations

import json
import random

import pytest

from icml.cli.errors import UsageError
from icml.methods.kv_compress.config import TASKS
from icml.methods.kv_compress.data import CUE, generate, generate_set, load_jsonl


def _solve(task: str, context: list[str], question: list[str]) -> str:
    """An independent reading of the context."""
    triples = [(context[i], context[i + 1]) for i in range(len(context) - 2) if context[i + 2] == ";"]
    if task == "kv_retrieval":
        return {k: v for k, v in triples if k.startswith("k")}[question[1]]
    if task == "needle":
        return dict(triples)["magic"]
    return str(sum(v == question[1] for k, v in triples if k.startswith("k")) % 10)


@pytest.mark.parametrize("task", TASKS)
def test_generated_answers_are_correct(task):
    rng = random.Random(0)
    for i in range(200):
        example = generate(task, i, rng, 160, 320)
        context, question = example.context.split(), example.question.split()
        assert 160 <= len(context) <= 320 and question[-1] == CUE
        assert _solve(task, context, question) == example.answer
        if task != "needle":
            keys = [context[i] for i in range(len(context) - 2) if context[i + 2] == ";"]
            assert 24 <= len(keys) <= 40 and len(set(keys)) == len(keys)


@pytest.mark.parametrize("task", TASKS)
def test_training_questions_are_distinct_and_correct(task):
    rng = random.Random(1)
    for i in range(50):
        example = generate(task, i, rng, 32, 320, n_questions=8)
        asked = [(example.question, example.answer), *example.more]
        assert len(asked) == (1 if task == "needle" else 8) and len({q for q, _ in asked}) == len(asked)
        for question, answer in asked:
            assert _solve(task, example.context.split(), question.split()) == answer


def test_generation_is_deterministic_and_streams_differ():
    a = generate_set(TASKS, 5, 3, 160, 320, "test")
    assert a == generate_set(TASKS, 5, 3, 160, 320, "test")
    assert a != generate_set(TASKS, 5, 3, 160, 320, "calibration")


def test_jsonl_both_schemas(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"context": "a b c", "question": "q?", "answer": "b"}) + "\n\n"
                    + json.dumps({"context": "x y", "input": "which?", "answers": ["y", "z"]}) + "\n")
    examples = load_jsonl(path)
    assert [(e.question, e.answer, e.task) for e in examples] == [("q?", "b", "qa"), ("which?", "y", "qa")]


@pytest.mark.parametrize("text, problem", [
    ('{"context": "a", "question": "q"\n', "not valid JSON"),
    ('[1, 2]\n', "not a JSON object"),
    ('{"context": "a", "question": "q"}\n', "lacks string fields"),
    ("\n", "holds no examples"),
])
def test_malformed_jsonl_is_one_clear_error(tmp_path, text, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=problem):
        load_jsonl(path)
