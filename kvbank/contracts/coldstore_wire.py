"""The coldstore link's framing: a serialized protobuf header (proto/kvbank/v1/coldstore.proto),
then raw frames. Both ends and the tools that talk to a coldstore use these helpers, so the
framing is written once."""

from __future__ import annotations

from typing import Sequence

from kvbank.contracts.vocabulary import Outcome
from kvbank.v1 import coldstore_pb2 as pb

# What a Ping's `shm_probe` buffer holds: the coldstore that reads it there may be handed
# payloads in shared memory (Write.shm).
SHM_PROBE = b"kvbank shared-memory probe"

__all__ = ["pb", "request", "encode", "decode", "decode_request", "outcome_of", "outcome_pb"]


def request(req: int = 0, **op) -> pb.Request:
    """`request(7, ping=pb.Ping())`: one op, and the number its reply will carry (0: none)."""
    return pb.Request(req=req, **op)


def encode(msg, frames: Sequence = ()) -> list:
    """The multipart message: the header, then the frames as they are (zero-copy)."""
    return [msg.SerializeToString(), *frames]


def decode(parts: Sequence) -> tuple[pb.Message, list]:
    """A coldstore -> worker message and its frames."""
    return pb.Message.FromString(_bytes(parts[0])), list(parts[1:])


def decode_request(parts: Sequence) -> tuple[pb.Request, list]:
    """A worker -> coldstore request and its frames; raises ValueError on a bad header."""
    try:
        return pb.Request.FromString(_bytes(parts[0])), list(parts[1:])
    except Exception as e:  # protobuf's DecodeError and friends
        raise ValueError(f"not a coldstore request: {e}") from None


def outcome_of(done: pb.Done) -> Outcome:
    return Outcome(pb.Outcome.Name(done.outcome).removeprefix("OUTCOME_").lower())


def outcome_pb(outcome: Outcome | str) -> int:
    return pb.Outcome.Value("OUTCOME_" + str(outcome).upper())


def _bytes(part) -> bytes:
    return part.bytes if hasattr(part, "bytes") else bytes(part)
