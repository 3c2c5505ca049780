"""The control plane's encoding: allow-listed dataclasses and plain values as msgpack.

Tensor-parallel ranks exchange step plans and small replies over a group that anyone who
reaches its port can join, so reading a message must never run code (unpickling can). A
value travels as msgpack's plain types; a dataclass as ``[tag, field, ...]``, its tag from
the allow-list the codec was made with; a ``torch.dtype`` or ``torch.device`` as its name.
The reader walks the schema it expects (a type hint), builds only allow-listed types and
checks the type of every value on the way; anything else raises ``RefusedMessage``.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import msgpack
import torch

_Enc = Callable[[Any], Any]
_Dec = Callable[[Any], Any]

_PLAIN = (int, float, str, bool, bytes)
# Python's numeric tower: an int is a valid float (``temperature=0``); a bool is neither.
_ACCEPTS: dict[type, frozenset[type]] = {int: frozenset({int}), float: frozenset({float, int}),
                                         str: frozenset({str}), bool: frozenset({bool}),
                                         bytes: frozenset({bytes})}
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8")}
_DEVICE_TYPES = frozenset({"cpu", "cuda"})
_JSON_SCALARS = (type(None), bool, int, float, str)


class RefusedMessage(ValueError):
    """A control message that is not one the reader expects; nothing of it was built."""


def unpack(data: bytes) -> Any:
    """The plain values of a message, before any type is built."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # every malformed input: truncated, extra data, bad bytes
        raise RefusedMessage(f"not a msgpack message ({type(exc).__name__}: {exc})") from None


class Codec:
    """Encodes and decodes values of type hints built from plain types, ``Literal``,
    ``X | None``, ``list``/``tuple``/``set``/``frozenset``/``dict`` (string keys), ``Any``
    (JSON values), ``torch.dtype``, ``torch.device`` and the dataclasses in ``allowed``."""

    def __init__(self, allowed: Iterable[type]) -> None:
        self._allowed: dict[type, str] = {}
        for cls in allowed:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} is not a dataclass")
            if cls.__name__ in self._allowed.values():
                raise TypeError(f"two allowed dataclasses are named {cls.__name__}")
            self._allowed[cls] = cls.__name__
        self._plans: dict[Any, _Plan] = {}

    def encode(self, value: Any, schema: Any) -> bytes:
        return msgpack.packb(self._plan(schema).enc(value), use_bin_type=True)

    def decode(self, data: bytes, schema: Any) -> Any:
        return self.check(unpack(data), schema)

    def check(self, raw: Any, schema: Any) -> Any:
        """The value of type ``schema`` that ``raw`` (as ``unpack`` returns it) stands for."""
        try:
            return self._plan(schema).dec(raw)
        except RecursionError:
            raise RefusedMessage("message nested too deeply") from None

    # ---- schemas, compiled once per type hint ------------------------------------------------
    def _plan(self, schema: Any) -> _Plan:
        plan = self._plans.get(schema)
        if plan is None:
            plan = self._plans[schema] = self._compile(schema)
        return plan

    def _compile(self, tp: Any) -> _Plan:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp in _PLAIN:
            return _plain(_ACCEPTS[tp], tp.__name__)
        if tp is type(None):
            return _plain(frozenset({type(None)}), "None")
        if tp is Any:
            return _Plan(_identity, _json_dec)
        if tp is torch.dtype:
            return _Plan(_dtype_enc, _dtype_dec)
        if tp is torch.device:
            return _Plan(str, _device_dec)
        if origin is typing.Literal:
            return _Plan(_identity, _literal_dec(args))
        if origin in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1 or len(args) != 2:
                raise TypeError(f"unsupported union {tp}: only X | None")
            return _optional(self._plan(rest[0]))
        if origin in (list, tuple, set, frozenset):
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                return _fixed_tuple([self._plan(a) for a in args])
            return _sequence(origin, self._plan(args[0]))
        if origin is dict:
            if args[0] is not str:
                raise TypeError(f"unsupported {tp}: dictionary keys travel as strings")
            return _mapping(self._plan(args[1]))
        if tp in self._allowed:
            return self._dataclass(tp)
        raise TypeError(f"{tp} cannot travel on the control plane")

    def _dataclass(self, cls: type) -> _Plan:
        tag = self._allowed[cls]
        fields = dataclasses.fields(cls)  # init=False ones too: they travel as computed
        hints = typing.get_type_hints(cls)
        names = [f.name for f in fields]
        plans = [self._plan(hints[name]) for name in names]
        getter = _getter(names)
        convert = [(i, p.enc) for i, p in enumerate(plans) if p.enc is not _identity]
        check = _Fields(tag, names, plans)
        # A dataclass whose __init__ only assigns is built by it; the others field by field:
        # their __init__ may do work (StructuredOutput compiles its grammar) or run checks
        # that the sender already ran.
        plain_init = (not hasattr(cls, "__post_init__") and all(f.init for f in fields))

        def enc(v: Any) -> list:
            if type(v) is not cls:
                raise TypeError(f"expected {tag}, got {_describe(v)}")
            values = getter(v)
            if convert:
                values = list(values)
                for i, e in convert:
                    values[i] = e(values[i])
            return [tag, *values]

        def dec(v: Any) -> Any:
            if type(v) is not list or not v or v[0] != tag:
                got = v[0] if type(v) is list and v and type(v[0]) is str else _describe(v)
                raise RefusedMessage(f"expected {tag}, got {got!r:.60}")
            values = check(v, 1)
            if plain_init:
                return cls(*values)
            obj = cls.__new__(cls)
            for name, value in zip(names, values):
                object.__setattr__(obj, name, value)
            return obj

        return _Plan(enc, dec)


class _Plan(NamedTuple):
    """How one type hint travels. ``accepts``: when a value is checked by its type alone
    (and travels as it is), the types it may have; containers check those in bulk."""

    enc: _Enc
    dec: _Dec
    accepts: frozenset[type] | None = None


class _Fields:
    """Checks and decodes a fixed run of values (a dataclass's fields, a tuple's items): the
    values checked by their one type alone in one comparison, the others one by one."""

    def __init__(self, what: str, names: list[str], plans: list[_Plan]) -> None:
        self.what, self.names, self.plans = what, names, plans
        self.n = len(plans)
        exact = [i for i, p in enumerate(plans) if p.accepts is not None and len(p.accepts) == 1]
        self.exact_types = tuple(next(iter(plans[i].accepts)) for i in exact)
        self.exact = _getter(exact, item=True)
        self.rest = [(i, p.dec) for i, p in enumerate(plans) if i not in exact]

    def __call__(self, v: list, start: int) -> list:
        if len(v) != start + self.n:
            raise RefusedMessage(f"expected {self.what} of {self.n} values, got {len(v) - start}")
        values = v[start:]
        if tuple(map(type, self.exact(values))) != self.exact_types:
            self._refuse(values)
        for i, d in self.rest:
            try:
                values[i] = d(values[i])
            except RefusedMessage as exc:
                raise RefusedMessage(f"{self.what}.{self.names[i]}: {exc}") from None
        return values

    def _refuse(self, values: list) -> None:
        for name, plan, x in zip(self.names, self.plans, values):
            try:
                plan.dec(x)
            except RefusedMessage as exc:
                raise RefusedMessage(f"{self.what}.{name}: {exc}") from None
        raise RefusedMessage(f"{self.what}: values of unexpected types")


def _getter(keys: list, item: bool = False) -> Callable[[Any], tuple]:
    """The values at ``keys`` (attributes, or indices with ``item``), always as a tuple."""
    if not keys:
        return lambda v: ()
    get = (operator.itemgetter if item else operator.attrgetter)(*keys)
    return get if len(keys) > 1 else (lambda v: (get(v),))


def _identity(value: Any) -> Any:
    return value


def _describe(value: Any) -> str:
    return type(value).__name__


def _plain(accepts: frozenset[type], name: str) -> _Plan:
    def dec(v: Any) -> Any:
        if type(v) not in accepts:
            raise RefusedMessage(f"expected {name}, got {_describe(v)}")
        return v

    return _Plan(_identity, dec, accepts)


def _optional(plan: _Plan) -> _Plan:
    if plan.accepts is not None:
        return _plain(plan.accepts | {type(None)}, "a value or None")
    enc, dec = plan.enc, plan.dec
    return _Plan(lambda v: None if v is None else enc(v), lambda v: None if v is None else dec(v))


def _sequence(kind: type, item: _Plan) -> _Plan:
    build = None if kind is list else kind
    name = kind.__name__
    if item.accepts is not None:  # the hot case (token and block ids): one pass in C
        accepts = item.accepts

        def dec_plain(v: Any) -> Any:
            if type(v) is not list or not set(map(type, v)) <= accepts:
                raise RefusedMessage(f"expected a {name} of {'/'.join(sorted(t.__name__ for t in accepts))}, "
                                     f"got {_describe(v)}")
            return v if build is None else build(v)

        return _Plan(_identity if kind is list else list, dec_plain)
    enc_item, dec_item = item.enc, item.dec

    def dec(v: Any) -> Any:
        if type(v) is not list:
            raise RefusedMessage(f"expected a {name}, got {_describe(v)}")
        items = [dec_item(x) for x in v]
        return items if build is None else build(items)

    return _Plan(lambda v: [enc_item(x) for x in v], dec)


def _fixed_tuple(plans: list[_Plan]) -> _Plan:
    check = _Fields("tuple", [f"[{i}]" for i in range(len(plans))], plans)
    encs = [p.enc for p in plans]

    exact = tuple(next(iter(p.accepts)) for p in plans if p.accepts is not None and len(p.accepts) == 1)
    if len(exact) != len(plans):
        exact = None

    def dec(v: Any) -> tuple:
        if type(v) is not list:
            raise RefusedMessage(f"expected a tuple, got {_describe(v)}")
        if exact is not None and tuple(map(type, v)) == exact:  # a sampled token: (str, int)
            return tuple(v)
        return tuple(check(v, 0))

    if all(e is _identity for e in encs):
        return _Plan(_identity, dec)
    return _Plan(lambda v: [e(x) for e, x in zip(encs, v)], dec)


def _mapping(value: _Plan) -> _Plan:
    def keys_ok(v: Any) -> bool:
        return type(v) is dict and set(map(type, v)) <= {str}

    if value.accepts is not None:
        accepts = value.accepts

        def dec_plain(v: Any) -> dict:
            if not keys_ok(v) or not set(map(type, v.values())) <= accepts:
                raise RefusedMessage(f"expected a dict of str to {'/'.join(sorted(t.__name__ for t in accepts))}, "
                                     f"got {_describe(v)}")
            return v

        return _Plan(_identity, dec_plain)
    enc_value, dec_value = value.enc, value.dec

    def dec(v: Any) -> dict:
        if not keys_ok(v):
            raise RefusedMessage(f"expected a dict with string keys, got {_describe(v)}")
        return {k: dec_value(x) for k, x in v.items()}

    return _Plan(lambda v: {k: enc_value(x) for k, x in v.items()}, dec)


def _literal_dec(values: tuple) -> _Dec:
    def dec(v: Any) -> Any:
        if type(v) not in _PLAIN or v not in values:
            raise RefusedMessage(f"expected one of {values}, got {v!r:.60}")
        return v

    return dec

def _json_dec(v: Any) -> Any:
    """A JSON value (a schema inside a structured-output constraint)."""
    if isinstance(v, list):
        for x in v:
            _json_dec(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            if type(k) is not str:
                raise RefusedMessage(f"expected a JSON object key, got {_describe(k)}")
            _json_dec(x)
    elif type(v) not in _JSON_SCALARS:
        raise RefusedMessage(f"expected a JSON value, got {_describe(v)}")
    return v


def _dtype_enc(v: torch.dtype) -> str:
    return str(v).removeprefix("torch.")


def _dtype_dec(v: Any) -> torch.dtype:
    if type(v) is not str or v not in _DTYPES:
        raise RefusedMessage(f"expected a dtype name of {sorted(_DTYPES)}, got {v!r:.60}")
    return _DTYPES[v]


def _device_dec(v: Any) -> torch.device:
    if type(v) is not str:
        raise RefusedMessage(f"expected a device name, got {_describe(v)}")
    try:
        device = torch.device(v)
    except RuntimeError:
        raise RefusedMessage(f"not a device: {v!r:.60}") from None
    if device.type not in _DEVICE_TYPES:
        raise RefusedMessage(f"device type {device.type!r} is not one of {sorted(_DEVICE_TYPES)}")
    return device
