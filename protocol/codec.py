"""Typed msgpack encoder/decoder pairs. Decoding never applies half a message: it returns or raises."""

from typing import Any, Generic, TypeVar

import msgspec

from protocol.kv_events import KVEventBatch
from protocol.messages import ClientMessage, EngineCoreOutputs, EngineToWorker, WorkerToEngine

T = TypeVar("T")


class ProtocolError(ValueError):
    """Bytes that are not a valid message of the expected type."""


class Codec(Generic[T]):
    def __init__(self, type_: Any) -> None:
        self.type = type_
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type_)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"cannot decode {len(data)} bytes as {_name(self.type)}: {e}") from None


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or " | ".join(a.__name__ for a in type_.__args__)


def client_codec() -> Codec[ClientMessage]:
    return Codec(ClientMessage)


def outputs_codec() -> Codec[EngineCoreOutputs]:
    return Codec(EngineCoreOutputs)


def engine_to_worker_codec() -> Codec[EngineToWorker]:
    return Codec(EngineToWorker)


def worker_to_engine_codec() -> Codec[WorkerToEngine]:
    return Codec(WorkerToEngine)


def kv_events_codec() -> Codec[KVEventBatch]:
    return Codec(KVEventBatch)
