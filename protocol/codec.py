"""The one msgpack codec. Never pickle: a frame is data, and a malformed one is a ProtocolError."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from protocol.messages import I32, MESSAGE_TYPES

VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_NESTING = 2  # a StepPlan's NewRows and their RowSampling; deeper is malformed (and would exhaust the stack)


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol version; `request_id` when one could be read."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode(msg: object) -> bytes:
    frame = msgpack.packb({"v": VERSION, **_to_wire(msg)}, use_bin_type=True, default=_to_wire)
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{type(msg).__name__} is {len(frame)} bytes, over the {MAX_FRAME_BYTES}-byte cap")
    return frame


def decode(frame: bytes) -> object:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte cap")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)  # limits default to len(frame)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map with a 'type' tag, got {type(obj).__name__}")
    try:
        if obj.get("v") != VERSION:
            raise ProtocolError(f"protocol version {obj.get('v')!r} is not supported: this engine speaks {VERSION}")
        return _from_wire(obj)
    except ProtocolError as e:  # the receiver can then answer the request itself
        request_id = obj.get("request_id")
        e.request_id = request_id if isinstance(request_id, str) else None
        raise


def _to_wire(obj):
    """msgpack's hook for what it cannot pack: messages, arrays (raw little-endian bytes), numpy scalars."""
    if dataclasses.is_dataclass(obj):
        return {"type": type(obj).__name__, **{name: getattr(obj, name) for name in obj.WIRE}}
    if isinstance(obj, np.ndarray):
        return obj.astype(obj.dtype.newbyteorder("<"), copy=False).tobytes()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode a {type(obj).__name__}")


def _from_wire(obj: dict, depth: int = 0):
    if depth > MAX_NESTING:
        raise ProtocolError(f"messages nested more than {MAX_NESTING} deep (StepPlan > NewRow > RowSampling)")
    name = obj.get("type")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}: known types are {sorted(MESSAGE_TYPES)}")
    kwargs = {}
    for field, kind in cls.WIRE.items():
        if field not in obj:
            raise ProtocolError(f"{name} lacks field {field!r}")
        value = kwargs[field] = obj[field]
        if kind == I32:
            if not isinstance(value, bytes) or len(value) % 4:
                raise ProtocolError(f"{name}.{field} must be raw {kind} bytes")
            kwargs[field] = np.frombuffer(value, dtype="<i4")
        elif dataclasses.is_dataclass(kind):
            if not isinstance(value, dict) or value.get("type") != kind.__name__:
                raise ProtocolError(f"{name}.{field} must be a {kind.__name__} map")
            kwargs[field] = _from_wire(value, depth + 1)
        elif kind is list and isinstance(value, list):
            kwargs[field] = [_from_wire(v, depth + 1) if isinstance(v, dict) and "type" in v else v for v in value]
        elif kind is int and isinstance(value, bool):
            raise ProtocolError(f"{name}.{field} must be int, got bool")
        elif not isinstance(value, kind):
            raise ProtocolError(f"{name}.{field} has type {type(value).__name__}, expected {kind}")
    return cls(**kwargs)
