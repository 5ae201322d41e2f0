"""One generic serializer for every inter-process message: msgpack, with dataclasses and tensors.

A registered dataclass travels as a map tagged with its class name; a tensor as raw bytes with its dtype and
shape. Only registered classes can be rebuilt, so a peer cannot make this process construct arbitrary types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import torch

T = TypeVar("T")

_TYPE_KEY = "\x00type"  # keys no user payload (chat messages, stats) will ever use
_TENSOR_KEY = "\x00tensor"
_CLASSES: dict[str, type[Any]] = {}


def serializable(cls: type[T]) -> type[T]:
    """Register a dataclass so that `dumps`/`loads` can carry it (decorator)."""
    assert dataclasses.is_dataclass(cls), f"{cls.__name__} must be a dataclass"
    name = cls.__name__
    assert _CLASSES.get(name, cls) is cls, f"two serializable classes are named {name}"
    _CLASSES[name] = cls
    return cls


def _encode(obj: Any) -> Any:
    """msgpack's `default` hook: called for every object msgpack does not know natively."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {_TENSOR_KEY: [str(t.dtype).removeprefix("torch."), list(t.shape), raw]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if _CLASSES.get(name) is not type(obj):
            raise TypeError(f"{name} is not registered with @serializable")
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields[_TYPE_KEY] = name
        return fields
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot serialize an object of type {type(obj).__name__}")


def _decode(obj: dict[Any, Any]) -> Any:
    """msgpack's `object_hook`: rebuilds tagged maps, innermost first."""
    if _TENSOR_KEY in obj:
        dtype, shape, raw = obj[_TENSOR_KEY]
        flat = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(getattr(torch, dtype)).reshape(shape)
    name = obj.pop(_TYPE_KEY, None)
    if name is None:
        return obj
    cls = _CLASSES.get(name)
    if cls is None:
        raise TypeError(f"received a message of unknown type {name!r}")
    return cls(**obj)


def dumps(obj: Any) -> bytes:
    """Serialize a message (any nesting of registered dataclasses, tensors, lists, dicts, scalars)."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def loads(data: bytes) -> Any:
    """Inverse of `dumps`."""
    return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=False)


Encoder = Callable[[Any], bytes]
Decoder = Callable[[bytes], Any]
