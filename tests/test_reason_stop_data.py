"""The synthetic overthinking traces: their grammar and arithmetic, the corruption rates, the
re-check distribution, determinism and split separation; the word tokenizer; real JSONL files and
answer normalisation."""
from __future__ import annotations

import json
import math

import pytest

from icml.cli.errors import UsageError
from icml.methods.reason_stop.config import preset
from icml.methods.reason_stop.data import (JUMP_PHRASE, VOCAB, build_tokenizer, encode_trace, extract_answer,
                                           generate_traces, last_boxed, load_jsonl, normalise_answer, segment, solve,
                                           held_out_problems)

N = 3000


@pytest.fixture(scope="module")
def traces():
    return generate_traces(preset("default"), 0, "train", N)


def segments(words: list[str]) -> tuple[list[list[str]], list[str]]:
    """Split a trace body into its segments and the words that open them (ATP words / jump phrase)."""
    body = words[1:words.index("</think>")]
    out, openers, current = [], [], []
    i = 0
    while i < len(body):
        if body[i:i + len(JUMP_PHRASE)] == JUMP_PHRASE:
            out.append(current)
            openers.append("jump")
            current, i = [], i + len(JUMP_PHRASE)
        elif body[i] in ("wait", "hmm"):
            out.append(current)
            openers.append(body[i])
            current, i = [], i + 1
        else:
            current.append(body[i])
            i += 1
    return out + [current], openers


def test_traces_follow_the_grammar(traces):
    for trace in traces:
        problem = trace.problem
        assert trace.words[0] == "<think>" and trace.words[-4:-2] == ["</think>", "F"] and trace.words[-1] == "<eos>"
        segs, openers = segments(trace.words)
        assert trace.words[-2] == segs[-1][-1]  # d copies the last segment's answer
        correct = segment(problem.operands, problem.ops)
        assert correct[-1] == problem.answer == str(solve(problem.operands, problem.ops))
        for seg in segs:  # every segment is a chain over the question's operands, one result possibly off
            assert len(seg) == len(correct) and seg[1::6] == correct[1::6] and seg[2::6] == correct[2::6]
            results = seg[4::6]
            for k in range(1, len(results)):
                assert seg[6 * k] == results[k - 1]  # each step starts from the previous result (errors propagate)
        if trace.kind == "first_error":
            assert segs[0] != correct and segs[1] == correct
        elif trace.kind == "loop":
            jump = openers.index("jump")  # openers[j] opens segs[j + 1]
            assert 1 <= jump <= 2 and all(s == segs[0] for s in segs[:jump + 1]) and segs[0] != correct
            assert segs[jump + 1] == correct
        else:
            assert segs[0] == correct and "jump" not in openers


def test_corruption_rates_and_recheck_distribution(traces):
    def within(count: int, p: float) -> bool:  # 4 binomial standard deviations
        return abs(count - N * p) <= 4 * math.sqrt(N * p * (1 - p))

    kinds = [t.kind for t in traces]
    assert within(kinds.count("first_error"), 0.2) and within(kinds.count("loop"), 0.1)
    clean = [t for t in traces if t.kind == "clean"]
    weights = [0.05, 0.1, 0.15, 0.3, 0.4]
    for r, w in enumerate(weights):
        count = sum(t.n_rechecks == r for t in clean)
        assert abs(count - len(clean) * w) <= 4 * math.sqrt(len(clean) * w * (1 - w))
    slipped = total = 0
    for trace in clean:
        segs, _ = segments(trace.words)
        correct = segment(trace.problem.operands, trace.problem.ops)
        slipped += sum(s != correct for s in segs[1:])
        total += len(segs) - 1
    assert abs(slipped - 0.15 * total) <= 4 * math.sqrt(total * 0.15 * 0.85)
    atps = [sum(w in ("wait", "hmm") for w in t.words) for t in traces]
    assert sum(atps) / N > 2.5  # overthinking by construction: E[R] = 2.9 re-checks


def test_determinism_splits_and_lengths():
    cfg = preset("default")
    a, b = generate_traces(cfg, 3, "train", 50), generate_traces(cfg, 3, "train", 50)
    assert [t.words for t in a] == [t.words for t in b]
    assert [t.words for t in generate_traces(cfg, 4, "train", 50)] != [t.words for t in a]
    train_questions = {t.problem.question for t in a}
    tests = held_out_problems(cfg, 3, 50)
    assert [p.question for p in tests] == [p.question for p in held_out_problems(cfg, 3, 50)]
    assert [p.question for p in tests] != [t.problem.question for t in a]  # a stream of its own
    assert len(train_questions) > 40
    vocab = {w: i for i, w in enumerate(VOCAB)}
    longest = max(len(encode_trace(t, vocab)[0]) for t in generate_traces(cfg, 0, "train", 2000))
    assert longest <= cfg.max_length


def test_tokenizer_is_word_level_over_the_vocabulary():
    tokenizer = build_tokenizer()
    assert len(tokenizer) == len(VOCAB) == 29
    trace = generate_traces(preset("smoke"), 0, "val", 1)[0]
    ids, think_at = encode_trace(trace, {w: i for i, w in enumerate(VOCAB)})
    text = trace.problem.question + " " + " ".join(trace.words)
    assert tokenizer(text)["input_ids"] == ids and ids[think_at] == VOCAB.index("<think>")
    assert tokenizer.decode(ids) == "<bos> " + text


def test_answers_are_extracted_and_normalised():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and then \boxed{3}") == "3"
    assert last_boxed(r"\boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert normalise_answer(r"\boxed{\dfrac{1}{2}}") == r"\frac{1}{2}"
    assert normalise_answer(" $1,000$. ") == "1000"
    assert normalise_answer("12.0") == "12"
    assert normalise_answer(r"\left( 1, 2 \right)") == "(1,2)"
    assert normalise_answer(r"30^\circ") == "30"
    assert extract_answer(r"The answer is \boxed{ 42 }.", boxed=True) == "42"
    assert extract_answer("F 7 <eos>", boxed=False) == "7"
    assert extract_answer("F <eos>", boxed=False) is None and extract_answer("7", boxed=False) is None


def test_jsonl_files_load_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n\n" + json.dumps({"question": "x", "answer": "y"}))
    problems = load_jsonl(good)
    assert [(p.question, p.answer) for p in problems] == [("1+1?", "2"), ("x", "y")]
    for text, message in (('{"question": "a"\n', "line 1 is not valid JSON"),
                          ('{"question": "a", "answer": "b"}\n{"answer": 3}\n', "line 2 lacks"),
                          ("\n", "holds no problems")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(UsageError, match=message):
            load_jsonl(bad)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(bytes([0xff, 0xfe, 0x00]))
    with pytest.raises(UsageError, match="not a text file"):
        load_jsonl(binary)
