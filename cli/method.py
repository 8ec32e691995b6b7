"""What a method declares to the workbench, in its package's `__init__.py`.

The declaration is cheap to import (no torch): the CLI builds every method's help from it.
The heavy parts are named by module and imported only when a command runs:
- `<package>.pipeline` with `train(ctx)` and `evaluate(ctx)`;
- `<package>.report` with `tables(frame, config)`, `plots(frame, config)` (either may also take
  `run=` to read the run's extra tables) and optionally `headline(frame)`;
- optionally `<package>.verbs` with `register(app)` for method-specific commands.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

PRESETS = ("smoke", "default", "paper")
RESULTS = ("reproduced", "partly", "not at this scale")  # Method.result
HIGHER, LOWER = "higher", "lower"


@dataclass(frozen=True)
class Method:
    name: str  # the subcommand, e.g. "belief-filter"
    package: str  # e.g. "icml.methods.belief_filter"
    title: str  # the paper's title
    arxiv: str
    status: str  # complete | partial | planned
    summary: str  # one line for `icml list` and help
    config: type  # the root config dataclass
    preset: Callable[[str], Any]  # preset name -> config instance
    validate: Callable[[Any], None] | None = None  # raises ValueError with a one-line message
    # Reads the content of the user's inputs (--data / --model: headers, first rows, a checkpoint's config)
    # before a run directory exists; raises ValueError or IcmlError naming the problem. Runs after validate.
    check_inputs: Callable[[Any], None] | None = None
    tags: dict[str, str] = field(default_factory=dict)  # tag column -> arrow type (string|int64|float64)
    metrics: dict[str, str | None] = field(default_factory=dict)  # metric -> higher | lower | None
    variants: tuple[str, ...] = ()
    extra_verbs: bool = False
    # Non-empty when every run seed gives the same results by design (why, in a few words): `--seeds`
    # then refuses, since copies of one run would pass for seeds. Otherwise the run seed must reach every
    # random choice of the method (data, injection, partition, init) — tests/test_seeds.py checks it.
    deterministic: str = ""
    preset_times: dict[str, str] = field(default_factory=dict)  # preset -> measured time on 2 cores, e.g. "≈ 40 s"
    # What the method's measured verdicts say of the paper at our scale: reproduced (the paper's headline claims
    # hold) | partly (some hold) | not at this scale (none shown). `icml list` prints it; the top README's
    # methods table carries the same word (tests/test_list_status.py).
    result: str = ""

    def part(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.package}.{name}")

    def better(self, metric: str) -> str | None:
        return self.metrics.get(metric)
