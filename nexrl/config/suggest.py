"""Unknown config keys: find them, and name the key that was probably meant.

Hydra rejects an unknown key in an override with "To append to your config use
+key=...", and the `+` form then adds the typo to the config, where nothing reads
it. `check_known_keys` walks a composed config against the schema dataclasses
and fails on any key the schema does not declare (keys inside free-form dict
fields such as `algorithm.loss_kwargs` are the user's own and pass);
`explain_unknown_key` rewrites Hydra's message into "unknown key ...; did you
mean ...". Suggestions come from `difflib` over every dotted schema key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

from nexrl.config.schema import RLTrainConfig


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key."""


_HYDRA_KEY = re.compile(r"Could not override '([^']+)'|full_key: (\S+)")


def _is_free_form(kind: object) -> bool:
    """A field whose keys are the user's: `dict[...]`, `Any`, or an optional of those."""
    if kind is Any:
        return True
    origin = typing.get_origin(kind)
    if origin in (dict, Mapping):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_free_form(a) for a in typing.get_args(kind) if a is not type(None))
    return False


def _schema_fields(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


@cache
def schema_keys(cls: type = RLTrainConfig, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key the schema declares, sections included."""
    keys: list[str] = []
    for name, kind in _schema_fields(cls).items():
        keys.append(prefix + name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            keys.extend(schema_keys(kind, f"{prefix}{name}."))
    return tuple(keys)


def suggest(key: str, candidates: tuple[str, ...] | None = None) -> list[str]:
    """Up to three known keys close to `key`: whole dotted key, then the last part
    within the same section (`train_worker.totl_steps` -> `...total_train_steps`)."""
    candidates = schema_keys() if candidates is None else candidates
    found = difflib.get_close_matches(key, candidates, n=3, cutoff=0.8)
    if found:
        return found
    found = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    section, _, leaf = key.rpartition(".")
    siblings = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == section}
    for name in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6):
        if siblings[name] not in found:
            found.append(siblings[name])
    return found[:3]


def unknown_key_message(key: str) -> str:
    hint = suggest(key)
    text = f"unknown config key '{key}'"
    if hint:
        text += "; did you mean " + " or ".join(f"'{h}'" for h in hint) + "?"
    else:
        section = key.rpartition(".")[0]
        valid = [c for c in schema_keys() if c.rpartition(".")[0] == section]
        text += f"; valid keys here: {', '.join(valid)}"
    return text + " (every key: docs/configuration.md)"


def _unknown(cfg: Mapping[str, object], cls: type, prefix: str) -> Iterator[str]:
    fields = _schema_fields(cls)
    for key in cfg:
        dotted = f"{prefix}{key}"
        if key not in fields:
            yield dotted
            continue
        value, kind = cfg[key], fields[key]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(value, Mapping):
            yield from _unknown(value, kind, dotted + ".")


def unknown_keys(cfg: Mapping[str, object]) -> list[str]:
    """Dotted keys of `cfg` that the schema does not declare (free-form dicts skipped)."""
    return list(_unknown(cfg, RLTrainConfig, ""))


def check_known_keys(cfg: Mapping[str, object]) -> None:
    """Raise `ConfigError` naming the first unknown key and the likely intended one."""
    bad = unknown_keys(cfg)
    if bad:
        raise ConfigError("; ".join(unknown_key_message(k) for k in bad))


def free_form_parent(key: str) -> str | None:
    """The free-form dict field that `key` sits in (`algorithm.loss_kwargs`), if any."""
    cls: type = RLTrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        kind = _schema_fields(cls).get(part)
        if kind is None:
            return None
        if _is_free_form(kind):
            return ".".join(parts[: i + 1])
        if not isinstance(kind, type):  # a leaf (`int | None`, ...): nothing below it
            return None
        cls = kind
    return None


def explain_unknown_key(message: str) -> str | None:
    """Hydra's "Could not override 'k' ... use +k=..." as "unknown config key 'k'; did
    you mean ...", or None when `message` is not about an unknown key. Inside a free-form
    dict the `+` form is right, and the message says so."""
    if "not in" not in message and "Could not override" not in message:
        return None
    match = _HYDRA_KEY.search(message)
    if match is None:
        return None
    key = match.group(1) or match.group(2)
    parent = free_form_parent(key)
    if parent is not None:
        return (
            f"'{parent}' is a free-form dict: add the key '{key}' with a leading '+', "
            f"e.g. nexrl train +{key}=VALUE"
        )
    if key in schema_keys():
        return None  # a known key that failed for another reason (type, value)
    return unknown_key_message(key)
