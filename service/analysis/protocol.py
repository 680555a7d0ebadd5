"""Messages between the HTTP processes and the analysis process, and their encoding.

ZeroMQ carries them: the analysis process binds one ROUTER socket, every HTTP process connects
a DEALER (ROUTER knows who asked, so one analysis process answers any number of HTTP
processes, and the answer for a process that is gone is dropped). msgspec's MessagePack encodes
them, as the engine core's messages are (service/engine/protocol.py). Each call carries a
number its answer repeats: a process may wait on several at once.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

SOCKET_NAME = "analysis"


def analysis_address(directory: Path) -> str:
    """The analysis process's socket in a run directory (a lone server's own, or the supervisor's)."""
    return f"ipc://{directory}/{SOCKET_NAME}"


class Hello(msgspec.Struct, tag=True):
    """Answered Ready once the models are loaded (their weight spectra may still be computing)."""


class Spectrum(msgspec.Struct, tag=True):
    texts: list[str] | None
    token_ids: list[list[int]] | None
    method: str
    layers: list[int] | None
    format: str
    compare: bool  # also the comparison model (the HTTP side checked that there is one)
    adapter: str | None = None  # a LoRA adapter's name: the served model with it applied
    compare_base: bool = False  # also the served model without the adapter


class Attention(msgspec.Struct, tag=True):
    token_ids: list[int]
    layers: list[int]
    format: str
    adapter: str | None = None


class Lens(msgspec.Struct, tag=True):
    token_ids: list[int]
    top_k: int
    adapter: str | None = None


class LoadAdapter(msgspec.Struct, tag=True):
    """Make a peft folder's adapter analysable under `name`: Done, or Refused ("validation") why not."""

    name: str
    folder: str


class UnloadAdapter(msgspec.Struct, tag=True):
    """Done, or Refused ("not_found"); analyses already using it finish with it."""

    name: str


class ListAdapters(msgspec.Struct, tag=True):
    """Done with a JSON list of the adapters' names."""


Call = Hello | Spectrum | Attention | Lens | LoadAdapter | UnloadAdapter | ListAdapters


class Request(msgspec.Struct):
    id: int
    call: Call


class Ready(msgspec.Struct, tag=True):
    pid: int


class Done(msgspec.Struct, tag=True):
    body: bytes
    media_type: str
    seconds: float  # the analysis itself, for gpt2_analysis_duration_seconds
    # A spectrum's matrices the fast method iterated on, and those it handed to LAPACK, for
    # gpt2_analysis_fast_matrices_total (an SVG answer carries no report to read them from).
    fast_iterated: int = 0
    fast_fallbacks: int = 0


class Refused(msgspec.Struct, tag=True):
    """The request cannot be analysed (422: "validation"), names an adapter that is not loaded
    (404: "not_found"), or every analysis slot is busy (429: "overloaded")."""

    kind: str
    message: str


class Failed(msgspec.Struct, tag=True):
    """The models could not be loaded (every call gets this), or the analysis raised."""

    message: str


Answer = Ready | Done | Refused | Failed


class Reply(msgspec.Struct):
    id: int
    answer: Answer


encoder = msgspec.msgpack.Encoder()
requests = msgspec.msgpack.Decoder(Request)
replies = msgspec.msgpack.Decoder(Reply)
