"""The keyword arguments `PackStream` took before it had `seat=`, `plan=` and `connection=`, turned into those:
one adapter, so the stream itself has one signature. Kept because v1 trainers pass them (`rank=`, `dp=`,
`token=`, ...), and documented there."""

from __future__ import annotations

import dataclasses
from typing import Any

from packfeed.client.stream.channel import Connection
from packfeed.v1.layout import Seat
from packfeed.v1.options import PlanConfig

_PLAN_FIELDS = {f.name for f in dataclasses.fields(PlanConfig)}
_CONNECTION_FIELDS = {f.name for f in dataclasses.fields(Connection)}
_SEAT_FIELDS = {"rank", "encoder_rank", "replica", "replicas", "cp_rank"}


def stream_arguments(seat: Seat | int | None, plan: PlanConfig | None, connection: Connection | None,
                     earlier: dict[str, Any]) -> tuple[Seat, PlanConfig, Connection, int]:
    """(seat, plan, connection, replicas) from the stream's own arguments and the earlier keywords: `rank=` (an
    LLM rank: `seat=rank`), `encoder_rank=`, `replica=` with `replicas=` (which it is checked against) and
    `cp_rank=` (the lane); the plan's and the connection's fields flat (`dp=2, strategy="isf", token=...`), where
    "" or 0 means the default as on the wire. Giving a group and its flat fields, or two seats, is an error."""
    unknown = sorted(set(earlier) - _PLAN_FIELDS - _CONNECTION_FIELDS - _SEAT_FIELDS)
    if unknown:
        raise TypeError(f"PackStream got unexpected keyword arguments {unknown}")
    plan_fields = {k: v for k, v in earlier.items() if k in _PLAN_FIELDS}
    connection_fields = {k: v for k, v in earlier.items() if k in _CONNECTION_FIELDS}
    if plan is not None and plan_fields:
        raise TypeError(f"give plan=PlanConfig(...) or its fields {sorted(plan_fields)}, not both")
    if connection is not None and connection_fields:
        raise TypeError(f"give connection=Connection(...) or its fields {sorted(connection_fields)}, not both")
    plan = plan or PlanConfig(**{k: v for k, v in plan_fields.items() if not _unset(v)})
    replica, replicas = earlier.get("replica", 0), earlier.get("replicas", 1)
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} of {replicas}: give 0 <= replica < replicas")
    return _seat(seat, earlier), plan, connection or Connection(**connection_fields), replicas


def _unset(value: Any) -> bool:
    """"" and 0 mean the default, as on the wire; False is a choice (collective_safe=False)."""
    return value is None or value == "" or (value == 0 and not isinstance(value, bool))


def _seat(seat: Seat | int | None, earlier: dict[str, Any]) -> Seat:
    """The stream's seat: `seat` (a Seat, or an LLM rank's number), or the earlier rank=/encoder_rank= with
    replica= and cp_rank= (exactly one of seat, rank and encoder_rank)."""
    rank, encoder_rank = earlier.get("rank"), earlier.get("encoder_rank")
    if sum(given is not None for given in (seat, rank, encoder_rank)) != 1:
        raise ValueError("give seat=Seat(...) (or seat=rank, an LLM rank; rank= and encoder_rank= still work): "
                         "exactly one of them")
    replica, lane = earlier.get("replica", 0), earlier.get("cp_rank", 0)
    if seat is not None:
        if replica or lane:
            raise ValueError("give the replica and the lane in the seat: Seat(rank, replica=..., lane=...)")
        return seat if isinstance(seat, Seat) else Seat(int(seat))
    return Seat(encoder_rank if rank is None else rank, replica, lane, encoder=rank is None)
