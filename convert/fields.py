"""Typed reads of config.json fields: a field of the wrong type is refused naming the file and the field, before any
arithmetic turns it into a traceback or a silently wrong model.

JSON gives any type anywhere: ``"hidden_size": "big"``, ``"num_hidden_layers": null``, ``"vocab_size": 1e400``
(parsed as inf), ``"tie_word_embeddings": "false"`` (a non-empty string, true to ``bool``). Every family reads its
config through these helpers instead of ``int()`` / ``float()`` / ``bool()``:

- ``integer``: an int (not a bool, float or string), at least ``minimum`` (1: a size or count), below 2**31 (the
  largest dimension Core ML takes) or ``maximum`` (``MAX_LAYERS`` for a layer count).
- ``number``: an int or a finite float (not a bool or string), positive unless told otherwise.
- ``flag``: a JSON ``true`` / ``false``.
- ``mapping``: an object (``rope_parameters``, ``rope_scaling``); ``strings``: a list of strings (``layer_types``).
- ``token_id``: a token id, a list of them (the first is taken) or null.
- ``section``: ``text_config`` when the config nests its text model there, else the config itself.

A field that is absent or null takes ``default`` (what transformers does with an unset field); without a default it
is refused as missing. Defaults are checked too, so that a size derived from other fields (``hidden_size //
num_attention_heads``) cannot slip through as 0.

The families' args dataclasses declare how each field is read (``declared``: the key, the kind, the default, the
bounds, the section it sits in) and one ``Reader`` reads them: the families' ``from_config`` keep only their
cross-field checks. The checks the families share are here too: ``rope`` (only the default RoPE),
``check_heads`` (query heads a multiple of key/value heads), ``partial_rotary`` / ``rotary_dim``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from convert.errors import InputError, quote

REQUIRED = object()
VALUE_LIMIT = 100  # characters of a quoted value in an error
INT_LIMIT = 2**31
MAX_LAYERS = 4096  # a layer count is looped over (every layer's tensors are listed): far past any real model's


def integer(config: dict, name: str, where: str, default=REQUIRED, *, minimum: int = 1, maximum: int = INT_LIMIT - 1,
            field: str | None = None, needed: str = "") -> int:
    """``config[name]`` as an int in ``minimum..maximum``; ``field`` names it in errors (default ``name``),
    ``needed`` ends the missing-field message (" needed for a Qwen3 model")."""
    value = _get(config, name, where, default, field, needed)
    return check_integer(value, field or name, where, minimum=minimum, maximum=maximum)


def check_integer(value, field: str, where: str, *, minimum: int = 1, maximum: int = INT_LIMIT - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        want = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        bound = "below 2**31" if maximum == INT_LIMIT - 1 else f"at most {maximum}"
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected {want} ({bound})")
    return value


def number(config: dict, name: str, where: str, default=REQUIRED, *, positive: bool = True,
           field: str | None = None) -> float:
    """``config[name]`` as a finite float (an int is taken too), positive unless ``positive`` is false."""
    value = _get(config, name, where, default, field, "")
    return check_number(value, field or name, where, positive=positive)


def check_number(value, field: str, where: str, *, positive: bool = True) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected a finite "
                         f"{'positive ' if positive else ''}number")
    return float(value)


def flag(config: dict, name: str, where: str, default: bool = False, *, field: str | None = None) -> bool:
    """``config[name]``: JSON true or false (a string "false" is refused, not read as true)."""
    return check_flag(_get(config, name, where, default, field, ""), field or name, where)


def check_flag(value, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected true or false")
    return value


def mapping(config: dict, name: str, where: str, *, field: str | None = None) -> dict:
    """``config[name]`` as an object; absent or null is ``{}``."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: field {field or name!r} is {_value(value)}; expected an object")
    return value


def strings(config: dict, name: str, where: str, *, field: str | None = None) -> list[str] | None:
    """``config[name]`` as a list of strings; None when absent or null."""
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: field {field or name!r} is {_value(value)}; expected a list of strings")
    return value


def token_id(value, field: str, where: str) -> int | None:
    """A token id field's value: an id, a list of ids (the first is the one a bundle records) or null."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_integer(item, f"{field}[{i}]", where, minimum=0)
        return value[0] if value else None
    return None if value is None else check_integer(value, field, where, minimum=0)


def section(config: dict, where: str) -> dict:
    """The text model's fields: ``text_config`` when present (vision-language configs), else ``config``."""
    if "text_config" not in config:
        return config
    text = config["text_config"]
    if not isinstance(text, dict):
        raise InputError(f"{where}: field 'text_config' is {_value(text)}; expected an object")
    return text


def _value(value) -> str:
    return quote(value, VALUE_LIMIT)


def _get(config: dict, name: str, where: str, default, field: str | None, needed: str):
    value = config.get(name)
    if value is not None:
        return value
    if default is REQUIRED:
        raise InputError(f"{where}: missing field {field or name!r}{needed}")
    return default


# ------------------------------------------------------------------------------------------------ declared fields

TOKEN, NATURAL, DERIVED = "token id", "non-negative integer", "derived"  # kinds beside int, float and bool
METADATA = "config.json"  # the key of a field's ``Declared`` in its dataclass metadata


@dataclasses.dataclass(frozen=True)
class Declared:
    """How one args field is read from config.json.

    - ``key``: the config key (default: the field's name); ``prefix`` goes before it in errors ("dflash_config.").
    - ``kind``: ``int`` (``check_integer``, ``minimum``..``maximum``), ``float`` (``check_number``, ``positive``),
      ``bool`` (``check_flag``), ``TOKEN`` (``token_id``), ``NATURAL`` (``check_natural``: a drafter's 0..``maximum``)
      or ``DERIVED`` (no key: ``default(reader)`` is the value).
    - ``default``: what an absent or null key gives, checked as a value is (``NATURAL``'s is not: None stays unset):
      a value, a callable of the reader (derived from fields read before it:
      ``lambda r: r["hidden_size"] // r["num_attention_heads"]``) or ``REQUIRED`` (refused as missing).
      ``zero_unset``: a 0 takes the default too (``value or default``).
    - ``fallback``: a field read (and checked) before any field is built, whose value is the default: a v4 config's
      top-level ``rope_theta`` under v5's ``rope_parameters.rope_theta`` (see ``rope_theta``).
    - ``sources``: the sections to look in, in order: "" (the section read: ``text_config`` or the config) or a
      name the reader was given ("top", "rope", "draft"); the first holding the key gives it (``skip_null``: the
      first holding a non-null value).
    """

    key: str | None = None
    kind: Any = int
    default: Any = REQUIRED
    minimum: int = 1
    maximum: int = INT_LIMIT - 1
    positive: bool = True
    zero_unset: bool = False
    fallback: Declared | None = None
    sources: tuple[str, ...] = ("",)
    skip_null: bool = False
    prefix: str = ""


def declared(key: str | None = None, *, init: Any = dataclasses.MISSING, **how) -> Any:
    """A dataclass field read from config.json as ``Declared(key, **how)`` says; ``init`` is its default as a
    constructor argument (for args made without a config)."""
    return dataclasses.field(default=init, metadata={METADATA: Declared(key, **how)})


def derived(compute: Callable[[Reader], Any]) -> Any:
    """A field computed from the config when its turn comes (``compute(reader)``), in declaration order."""
    return declared(kind=DERIVED, default=compute)


def rope_theta(default: float = 10000.0) -> Any:
    """RoPE's base: ``rope_parameters.rope_theta`` (transformers v5), else the top-level ``rope_theta`` (v4), else
    ``default``; the top-level field is checked whenever it is there."""
    return declared("rope_theta", kind=float, sources=("rope",), prefix="rope_parameters.",
                    fallback=Declared("rope_theta", kind=float, default=default))


def check_natural(value, field: str, where: str, *, maximum: int = INT_LIMIT - 1) -> int:
    """A drafter's integer field: 0..``maximum`` (its sizes are checked against 1 once all are read)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        bound = "below 2**31" if maximum == INT_LIMIT - 1 else f"at most {maximum}"
        raise InputError(f"{where}: field {field!r} is {quote(value)}; expected a non-negative integer ({bound})")
    return value


CHECKS = {
    int: lambda v, field, where, how: check_integer(v, field, where, minimum=how.minimum, maximum=how.maximum),
    float: lambda v, field, where, how: check_number(v, field, where, positive=how.positive),
    bool: lambda v, field, where, how: check_flag(v, field, where),
    TOKEN: lambda v, field, where, how: token_id(v, field, where),
    NATURAL: lambda v, field, where, how: check_natural(v, field, where, maximum=how.maximum),
}


class Reader:
    """Reads the declared fields of the args dataclass ``cls`` from config.json's sections, each once: ``r[name]``
    (or ``r.take(*names)``) reads the fields a cross-field check needs, in the order the family checks them;
    ``r.build(**values)`` reads the rest in declaration order (fallbacks first) and makes the args, ``values``
    giving the fields that are not declared. ``missing`` is the message of an absent required field (``{field!r}``
    names it); ``known`` values are there for defaults to read (``r["family"]``)."""

    def __init__(self, cls: type, where: str, sources: dict[str, dict], *, missing: str = "missing field {field!r}",
                 **known):
        self.cls, self.where, self.sources, self.missing = cls, where, sources, missing
        self.declared = {f.name: f.metadata[METADATA] for f in dataclasses.fields(cls) if METADATA in f.metadata}
        self.values: dict[str, Any] = dict(known)
        self.fallbacks: dict[str, Any] = {}

    def __getitem__(self, name: str):
        if name not in self.values:
            self.values[name] = self.read(self.declared[name], name)
        return self.values[name]

    def take(self, *names: str) -> tuple:
        return tuple(self[name] for name in names)

    def raw(self, name: str):
        """A declared field's value as the config gives it, unchecked (None when absent)."""
        how = self.declared[name]
        return self._find(how, how.key or name)

    def read(self, how: Declared, name: str | None = None):
        """The value ``how`` declares (``name``: the field's, the key unless ``how`` names one)."""
        key = how.key or name
        if how.kind is DERIVED:
            return how.default(self)
        if how.fallback is not None and name not in self.fallbacks:
            self.fallbacks[name] = self.read(how.fallback)
        value = self._find(how, key)
        if value is not None:
            value = CHECKS[how.kind](value, how.prefix + key, self.where, how)
            if value or not how.zero_unset:
                return value
        if how.fallback is not None:
            default = self.fallbacks[name]
        elif how.default is REQUIRED:
            raise InputError(f"{self.where}: " + self.missing.format(field=how.prefix + key))
        else:
            default = how.default(self) if callable(how.default) else how.default
        return default if how.kind is NATURAL else CHECKS[how.kind](default, how.prefix + key, self.where, how)

    def build(self, **values):
        self.values.update(values)
        for name, how in self.declared.items():
            if how.fallback is not None and name not in self.values and name not in self.fallbacks:
                self.fallbacks[name] = self.read(how.fallback)
        names = [f.name for f in dataclasses.fields(self.cls) if f.name in self.values or f.name in self.declared]
        return self.cls(**{name: self[name] for name in names})

    def _find(self, how: Declared, key: str):
        for source in how.sources:
            section = self.sources[source]
            if (section.get(key) is not None) if how.skip_null else key in section:
                return section[key]
        return None


# ------------------------------------------------------------------------------------------ shared config checks


def rope(config: dict, where: str, unsupported: str = " yet") -> dict:
    """``rope_parameters`` (an object; {} when absent), once the RoPE type is known to be the default one: v5's
    ``rope_parameters.rope_type``, v4's ``rope_scaling.rope_type`` / ``.type``; another is refused, the message
    saying it ``is not supported{unsupported}``."""
    parameters = mapping(config, "rope_parameters", where)
    scaling = mapping(config, "rope_scaling", where)
    rope_type = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise InputError(f"{where}: rope type {quote(rope_type)} is not supported{unsupported} (only 'default')")
    return parameters


def check_heads(heads: int, kv_heads: int, where: str) -> None:
    """Grouped-query attention: each key/value head serves the same number of query heads."""
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


def partial_rotary(rope_parameters: dict, config: dict, where: str, default: float) -> float:
    """``partial_rotary_factor``: in ``rope_parameters``, else at the top level, else ``default`` (transformers'
    ``convert_rope_params_to_dict``); any finite number here, ``rotary_dim`` bounds it."""
    partial = rope_parameters.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return check_number(default if partial is None else partial, "partial_rotary_factor", where, positive=False)


def rotary_dim(partial: float, head_dim: int, where: str, who: str = "") -> int:
    """The rotated leading dims of a head, ``int(head_dim * partial)`` (``compute_default_rope_parameters``): a
    positive even number, at most head_dim, or refused (``who`` is what needs it: "an MTP head ")."""
    dims = int(head_dim * partial) if 0 < partial <= 1 else 0
    if not (0 < partial <= 1 and dims > 0 and dims % 2 == 0):
        raise InputError(f"{where}: partial_rotary_factor={partial} gives {dims} rotary dims of head_dim {head_dim}: "
                         f"{who}needs a positive even number, at most head_dim")
    return dims
