"""Dotted config overrides, `{"train.steps": 2}`, applied in one place: the ablation rows, the
ablation study's QUICK sizes and the tests' SMALL sizes all go through `apply`."""

from __future__ import annotations

import ml_collections

from dapo_jax.errors import ConfigError


def get(c: ml_collections.ConfigDict, key: str):
    """The value at dotted `key`; a ConfigError naming the first part that is not a key."""
    node = c
    for i, part in enumerate(key.split(".")):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            where = ".".join(["config", *key.split(".")[:i]])
            valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            raise ConfigError(f"{where} has no key {part!r}; valid keys: {valid}")
        node = node[part]
    return node


def apply(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """`c` with each `{"section.field": value}` of `overrides` set, in order; every key must
    exist already (a typo is an error, not a new key)."""
    for key, value in overrides.items():
        get(c, key)
        *path, field = key.split(".")
        parent = get(c, ".".join(path)) if path else c
        parent[field] = value
    return c
