"""Each method's result at our scale (`Method.result`: reproduced | partly | not at this scale) is declared,
printed by `icml list` (plain columns and --json), and carried, word for word, by the top README's methods
table — one source of truth a reader sees in both places."""
from __future__ import annotations

import json
import re

from conftest import REPO, invoke
from icml.cli import registry
from icml.cli.method import RESULTS

README = REPO / "README.md"
ROW = re.compile(r"^\|\s*\[`(?P<name>[a-z0-9-]+)`\]\((?P<link>[^)]+)\)\s*\|(?P<paper>[^|]+)\|\s*(?P<result>[^|]+?)\s*\|\s*$")


def readme_methods_table() -> dict[str, tuple[str, str, str]]:
    """name -> (link, paper cell, result cell) of the README's methods table."""
    rows = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match:
            rows[match["name"]] = (match["link"], match["paper"].strip(), match["result"])
    return rows


def test_every_method_declares_a_result():
    for name in registry.METHODS:
        assert registry.get(name).result in RESULTS, (name, registry.get(name).result)


def test_icml_list_prints_each_methods_result():
    plain = invoke("list")
    assert plain.code == 0
    lines = plain.out.splitlines()
    header = lines[0].split()
    assert header[:2] == ["method", "result"], header
    for name in registry.METHODS:
        (line,) = [line for line in lines if line.split()[0] == name]
        after_name = line[len(name):].lstrip()
        assert after_name.startswith(registry.get(name).result + "  "), (name, line)
    listed = {m["name"]: m["result"] for m in json.loads(invoke("list", "--json").out)["methods"]}
    assert listed == {name: registry.get(name).result for name in registry.METHODS}


def test_the_readme_methods_table_carries_the_same_results():
    table = readme_methods_table()
    assert list(table) == list(registry.METHODS), "one row per registered method, in the registry's order"
    for name, (link, paper, result) in table.items():
        method = registry.get(name)
        assert result == method.result, (name, result, method.result)
        assert link == f"methods/{name.replace('-', '_')}/README.md", (name, link)
        # the paper's id spelled one way: [arXiv:NNNN.NNNNN](…), [OpenReview:ID](…) or [ICML 2026 poster N](…)
        assert re.search(r"\[(arXiv:\d{4}\.\d{4,5}|OpenReview:[A-Za-z0-9_-]+|ICML 2026 poster \d+)\]\(https://",
                         paper), (name, paper)
        if re.fullmatch(r"\d{4}\.\d{4,5}", method.arxiv):
            assert f"[arXiv:{method.arxiv}](https://arxiv.org/abs/{method.arxiv})" in paper, (name, paper)
