"""ARK's wire messages: :class:`Claim`, :class:`Ack`, :class:`Release`, typed, and their
dict form for a bus (:func:`message_to_dict`, :func:`message_from_dict`).

Both the protocol (:mod:`blink.fabric.ark`) and the buses that carry it
(:mod:`blink.fabric.bus`) import them from here, so a bus needs nothing of the protocol.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Claim:
    """``sender`` claims ``spine`` for a transfer from ``src_leaf`` to ``dst_leaf``.

    ``held``: the claim won (or needed no contest) and the transfer is running on it;
    ``shared``: every spine was held, so this transfer shares one and contests nothing.
    """

    lease_id: str
    sender: str
    stamp: int
    src_leaf: int
    dst_leaf: int
    spine: int
    held: bool = False
    shared: bool = False

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.stamp, self.sender, self.lease_id)


@dataclass(frozen=True)
class Ack:
    """``sender`` has recorded claim ``lease_id``."""

    lease_id: str
    sender: str
    stamp: int


@dataclass(frozen=True)
class Release:
    """``sender`` withdraws claim ``lease_id`` (lost, or the transfer finished)."""

    lease_id: str
    sender: str
    stamp: int


Message = Union[Claim, Ack, Release]
_MESSAGE_TYPES: dict[str, type] = {"ark.claim": Claim, "ark.ack": Ack, "ark.release": Release}
_TYPE_NAMES = {cls: name for name, cls in _MESSAGE_TYPES.items()}
_FIELD_TYPES = {"lease_id": str, "sender": str, "stamp": int, "src_leaf": int, "dst_leaf": int,
                "spine": int, "held": bool, "shared": bool}


def message_to_dict(message: Message) -> dict[str, Any]:
    return {"type": _TYPE_NAMES[type(message)], **asdict(message)}


def message_from_dict(data: Any) -> Message:
    """The typed message, or :class:`ValueError` naming what is wrong with ``data``."""
    if not isinstance(data, dict) or data.get("type") not in _MESSAGE_TYPES:
        raise ValueError(f"ARK message: unknown or missing type in {data!r:.200}")
    cls = _MESSAGE_TYPES[data["type"]]
    kwargs: dict[str, Any] = {}
    for name in cls.__dataclass_fields__:
        if name not in data:
            if cls.__dataclass_fields__[name].default is not MISSING:
                continue
            raise ValueError(f"ARK message {data['type']}: missing field {name!r}")
        value, want = data[name], _FIELD_TYPES[name]
        if type(value) is not want:  # noqa: E721  (bool is not an int here)
            raise ValueError(f"ARK message {data['type']}: {name} must be {want.__name__}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)
