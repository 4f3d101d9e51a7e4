"""The config's schema, beside its fields: every key of a config is a `Field`, its value with its
`Spec` (the type, the range "[a, b)" or the allowed values, and what None means where None is
allowed), declared once by the section builders of configs/common.py. The specs travel with the
values through variants, ablation rows and `--config.a.b=` overrides, and `check` finds every
key's rules in the config itself.

None is "off" (or "the default named by the spec"), never 0 or "". A key that allows None is
typed `object` for ml_collections, so that its command-line overrides are read as Python
literals: `--config.checkpoint.every_minutes=None` and `=30` both parse (config_flags' typed
parsers cannot read "None"); every other key keeps its type's parser.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from dapo_jax.errors import ConfigError

REQUIRED = object()  # a Spec's default: the variant must give the value
_NAMES = {int: "an int", float: "a float", str: "a str", bool: "a bool", tuple: "a tuple"}


def in_interval(value: float, interval: str) -> bool:
    """Whether `value` lies in `interval`, written "[a, b]", "(a, b)", "[a, inf)" and so on."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return above and below


@dataclasses.dataclass(frozen=True)
class Spec:
    """The rules of one key: values of type `kind` (an int passes for a float), in `range` (an
    interval, numbers only) or among `choices`; `none` says what None means where the key allows
    it (None: it does not); `default` where every variant shares the value."""

    kind: type
    range: str | None = None
    choices: tuple | None = None
    none: str | None = None
    default: Any = REQUIRED

    def allowed(self) -> str:
        """What the key takes, in words: "an int in [1, inf) or None (off)"."""
        text = f"one of {self.choices}" if self.choices else _NAMES[self.kind]
        text += f" in {self.range}" if self.range else ""
        return text + (f" or None ({self.none})" if self.none else "")

    def accepts(self, value) -> bool:
        """Whether `value` is of the kind (no bool for a number), among the choices, in the range."""
        if value is None:
            return self.none is not None
        if isinstance(value, bool) != (self.kind is bool):
            return False
        if not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if self.choices is not None and value not in self.choices:
            return False
        return self.range is None or in_interval(value, self.range)


class Field(ml_collections.FieldReference):
    """A config value and its `Spec`. Setting it (a variant's line, an override) keeps the spec."""

    def __init__(self, spec: Spec, value):
        self.spec = spec
        super().__init__(value, field_type=object if spec.none else spec.kind)

    def set(self, value, type_safe=True):
        if self.spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # ml_collections' own cast, for the keys typed `object`
        super().set(value, type_safe)

    def __setstate__(self, state):  # copies and pickles: FieldReference's restores its own fields only
        super().__setstate__(state)
        self.spec = state["spec"]


def section(values: dict, **specs: Spec) -> ml_collections.ConfigDict:
    """A config section of `specs` (each key's rules, in the order written), holding `values`
    (a variant's) or else the specs' defaults; a TypeError for a key missing or unknown."""
    unknown = sorted(set(values) - set(specs))
    missing = [k for k, s in specs.items() if k not in values and s.default is REQUIRED]
    if unknown or missing:
        raise TypeError(f"unknown keys {unknown}, missing keys {missing}; the section's keys: {list(specs)}")
    return ml_collections.ConfigDict({k: Field(s, values.get(k, s.default)) for k, s in specs.items()})


def fields(c: ml_collections.ConfigDict, prefix: str = ""):
    """`(dotted key, Field or plain value)` of every leaf of `c`."""
    for key, value in c.items(preserve_field_references=True):
        if isinstance(value, ml_collections.ConfigDict):
            yield from fields(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def problem(key: str, field, value) -> str | None:
    """The error for `value` at `key` (None when it is fine): the key, what it takes, the value."""
    if not isinstance(field, Field):
        return f"{key} has no schema: build its section with configs/common.py"
    if field.spec.accepts(value):
        return None
    fix = "; None is not allowed: set a value" if value is None else ""
    return f"{key} must be {field.spec.allowed()}, got {value!r}{fix}"


def check(c: ml_collections.ConfigDict) -> None:
    """A ConfigError for the first key of `c` whose value its spec does not accept."""
    for key, field in fields(c):
        message = problem(key, field, field.get() if isinstance(field, Field) else field)
        if message:
            raise ConfigError(message)
