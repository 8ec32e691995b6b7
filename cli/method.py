"""What a method declares to the workbench, in its package's `__init__.py`.

The declaration is cheap to import: `import icml.methods.<m>` imports this module and nothing else, since
`icml --help` and `icml list` read every method's declaration. Everything else is named by module and
imported only when used:
- `config_module` (by default `<package>.config`) holds the config dataclasses. The declaration names
  its root config class (`config="FgadConfig"`); `preset(name)`, `validate(cfg)` and `check_inputs(cfg)`
  are that module's functions of those names (`validate` and `check_inputs` may be absent), and
  `variants` may name one of its sequences (`variants="VARIANTS"`) or be a function of the module.
  `method.config`, `method.preset`, … import the module on first use and return the objects themselves,
  so callers never see the names. A declaration may still pass the objects (tests/toy_method does);
  conventions then look in the module of its config class;
- `<package>.pipeline` with `train(ctx)` and `evaluate(ctx)`;
- `<package>.report` with `tables(frame, config)`, `plots(frame, config)` (either may also take
  `run=` to read the run's extra tables) and optionally `headline(frame)`;
- optionally `<package>.verbs` with `register(app)` for method-specific commands.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable

PRESETS = ("smoke", "default", "paper")
RESULTS = ("reproduced", "partly", "not at this scale")  # Method.result
HIGHER, LOWER = "higher", "lower"


class _Convention:
    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG: Any = _Convention()  # the default of preset / validate / check_inputs: the config module's function


class _FromConfigModule:
    """A `Method` field whose declared value may be a name in the method's config module (a `str`), the
    convention `FROM_CONFIG` (the config module's attribute of the field's own name), or — for `variants` —
    a function of the config module; it is looked up on first read and kept. Any other value is the object
    itself. A dataclass field with a descriptor default: `__init__` stores the declared value through
    `__set__`, and reading the field goes through `__get__`, frozen or not."""

    def __init__(self, default: Any = None, *, required: bool = False, optional: bool = False,
                 convert: Callable[[Any], Any] | None = None, calls_module: bool = False):
        self.default, self.required, self.optional = default, required, optional
        self.convert, self.calls_module = convert, calls_module

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.declared, self.resolved = name, f"_declared_{name}", f"_resolved_{name}"

    def __set__(self, method: Method, value: Any) -> None:
        method.__dict__[self.declared] = value
        method.__dict__.pop(self.resolved, None)

    def __get__(self, method: Method | None, owner: type | None = None) -> Any:
        if method is None:  # the dataclass asks for the field's default
            if self.required:
                raise AttributeError(self.name)  # none: the declaration must give it
            return self.default
        if self.resolved not in method.__dict__:
            method.__dict__[self.resolved] = self._resolve(method, method.__dict__[self.declared])
        return method.__dict__[self.resolved]

    def is_reference(self, value: Any) -> bool:
        return value is FROM_CONFIG or isinstance(value, str) or (self.calls_module and callable(value))

    def _resolve(self, method: Method, value: Any) -> Any:
        if not self.is_reference(value):
            return value
        module = method.load_config_module()
        if self.calls_module and callable(value):
            value = value(module)
        else:
            attribute = self.name if value is FROM_CONFIG else value
            if not hasattr(module, attribute):
                if value is FROM_CONFIG and self.optional:
                    return None
                raise RuntimeError(f"{method.name}: Method.{self.name} names '{attribute}', which "
                                   f"{module.__name__} does not define")
            value = getattr(module, attribute)
        return self.convert(value) if self.convert is not None else value


@dataclass(frozen=True)
class Method:
    name: str  # the subcommand, e.g. "belief-filter"
    package: str  # e.g. "icml.methods.belief_filter"
    title: str  # the paper's title
    arxiv: str
    status: str  # complete | partial | planned
    summary: str  # one line for `icml list` and help
    # The root config dataclass, declared by its name in the config module: config="FgadConfig".
    config: type | str = _FromConfigModule(required=True)
    # preset name -> config instance; by default the config module's `preset`.
    preset: Callable[[str], Any] | str = _FromConfigModule(FROM_CONFIG)
    # Raises ValueError with a one-line message; by default the config module's `validate`, if any.
    validate: Callable[[Any], None] | str | None = _FromConfigModule(FROM_CONFIG, optional=True)
    # Reads the content of the user's inputs (--data / --model: headers, first rows, a checkpoint's config)
    # before a run directory exists; raises ValueError or IcmlError naming the problem. Runs after validate.
    # By default the config module's `check_inputs`, if any.
    check_inputs: Callable[[Any], None] | str | None = _FromConfigModule(FROM_CONFIG, optional=True)
    tags: dict[str, str] = field(default_factory=dict)  # tag column -> arrow type (string|int64|float64)
    metrics: dict[str, str | None] = field(default_factory=dict)  # metric -> higher | lower | None
    # The arms: a tuple, the name of a sequence in the config module ("VARIANTS"), or a function of that module
    # (lambda config: (*config.SELECTORS, "base")); read as a tuple.
    variants: tuple[str, ...] | str | Callable[[ModuleType], Iterable[str]] = _FromConfigModule(
        (), convert=tuple, calls_module=True)
    extra_verbs: bool = False
    # Non-empty when every run seed gives the same results by design (why, in a few words): `--seeds`
    # then refuses, since copies of one run would pass for seeds. Otherwise the run seed must reach every
    # random choice of the method (data, injection, partition, init) — tests/test_seeds.py checks it.
    deterministic: str = ""
    # Presets beyond smoke/default/paper that the method's `preset(name)` knows (e.g. ("real",)).
    presets: tuple[str, ...] = ()
    preset_times: dict[str, str] = field(default_factory=dict)  # preset -> measured time on 2 cores, e.g. "≈ 40 s"
    # What the method's measured verdicts say of the paper at our scale: reproduced (the paper's headline claims
    # hold) | partly (some hold) | not at this scale (none shown). `icml list` prints it; the top README's
    # methods table carries the same word (tests/test_list_status.py).
    result: str = ""
    # Where config, preset, validate, check_inputs and a named variants live: by default `<package>.config`,
    # or the module of a config class passed as the class itself.
    config_module: str = ""

    def __post_init__(self) -> None:
        if not self.config_module:
            declared = self.__dict__["_declared_config"]
            module = declared.__module__ if isinstance(declared, type) else f"{self.package}.config"
            object.__setattr__(self, "config_module", module)

    def load_config_module(self) -> ModuleType:
        """The config module, imported now if it was not yet (reading config, preset, … does it)."""
        return importlib.import_module(self.config_module)

    def part(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.package}.{name}")

    def preset_names(self) -> tuple[str, ...]:
        """smoke, default, paper and the method's own presets."""
        return PRESETS + tuple(p for p in self.presets if p not in PRESETS)

    def better(self, metric: str) -> str | None:
        return self.metrics.get(metric)
