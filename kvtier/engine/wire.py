"""The messages between a serving process and its engine (engine/client.py ⇄ engine/proc.py):
msgspec structs, msgpack-encoded over two ZeroMQ sockets, one each way. No torch, and no list
whose items mean something by their place::

    serving process ──► engine
        EngineRequest   a request to run: prompt ids, SamplingParams, cache_salt, its PD side,
                        its images (ImageData: hash, placeholder span, preprocessed pixels)
                        (export / handoff), owner, priority
        Abort           drop a request (every sample of it) and return its blocks
        Call            run one of engine/loop.py's CALLS between steps (its CallResult answers)
        Stop            end the loop (the requests in flight fail) and close the engine
    engine ──► serving process
        Phase*, Ready   the start's phases, then what the engine is (EngineInfo) ... or Failed
        EngineOutputs   what one iteration of the engine loop says:
          deltas        a RequestDelta per request whose tokens moved in it: new tokens per
                        sample (SampleDelta: ids, logprobs, finish reason), the prompt tokens not
                        computed (CachedTokens) on its first, P's export names and the engine's
                        stages (FirstTokenStages) with its first token, the final RequestOutput
                        on its last; or why it was refused
          results       the CallResults of the calls it ran
          status        queue lengths and the pool's health (EngineStatus), when they changed
          dead          why the engine stopped, in its very last message

SamplingParams and RequestOutput (engine/params.py, engine/outputs.py) travel as they are:
msgspec encodes dataclasses field by field and checks them as it decodes them
(``SamplingParams.__post_init__`` runs again in the engine). An ndarray (an output's MoE routing)
travels as its dtype, shape and bytes.
"""

from __future__ import annotations

import math
from typing import Any, Union

import msgspec
import numpy as np

from kvtier.engine.checks import RequestLimits
from kvtier.engine.outputs import RequestOutput
from kvtier.engine.params import SamplingParams
from kvtier.model.images import MMInput, image_hash

# ---------------------------------------------------------------------------- errors by kind


class QueueFull(RuntimeError):
    """More samples wait for admission than ``max_queue``: the caller should retry later (503)."""


class EngineDead(RuntimeError):
    """The engine stopped (closed, or a step raised): no request can be served."""


# a request's error kind -> what its caller raises (HTTP: value 400, queue and dead 503, internal 500)
ERRORS: dict[str, type[Exception]] = {"value": ValueError, "queue": QueueFull, "dead": EngineDead, "internal": RuntimeError}


def error_kind(e: BaseException) -> str:
    if isinstance(e, QueueFull):
        return "queue"
    if isinstance(e, EngineDead):
        return "dead"
    if isinstance(e, ValueError):
        return "value"
    return "internal"


# ---------------------------------------------------------------------------- serving process -> engine


class ImageData(msgspec.Struct, frozen=True):
    """One image of a request, preprocessed by the serving process (model/images.py): its
    content hash, its placeholder tokens [offset, offset + length) and its pixels, float32
    little-endian of ``shape`` (channels, side, side). A request carries at most
    ``max_images_per_request`` of them, each of the model's one image shape."""

    hash: bytes
    offset: int
    length: int
    shape: tuple[int, int, int]
    pixels: bytes


def image_data(image: MMInput) -> ImageData:
    """An image as the wire carries it."""
    c, h, w = image.pixels.shape
    return ImageData(image.hash, image.offset, image.length, (c, h, w), np.ascontiguousarray(image.pixels, "<f4").tobytes())


def mm_input(data: ImageData) -> MMInput:
    """An image off the wire; ValueError if its bytes are not its shape's, or its hash not theirs
    (the hash keys the image's KV blocks and its tower output: the engine trusts no sender's)."""
    if len(data.shape) != 3 or math.prod(data.shape) * 4 != len(data.pixels) or min(data.shape) <= 0:
        raise ValueError(f"image pixels of {len(data.pixels)} bytes do not make float32 {list(data.shape)}")
    pixels = np.frombuffer(data.pixels, "<f4").reshape(data.shape)
    if image_hash(pixels) != data.hash:
        raise ValueError("an image's hash is not the hash of its pixels")
    return MMInput(data.hash, data.offset, data.length, pixels)


class EngineRequest(msgspec.Struct, tag="add", frozen=True):
    """A request as the serving process checked it (engine/checks.py); the engine makes its own
    Request of it (and checks it again)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    handoff: dict[str, Any] | None = None  # D of a PD hand-off: P's manifest (the engine checks it)
    export: bool = False  # P of a PD hand-off: write the prompt's blocks to the pool
    owner: str = ""  # the call it belongs to ("": itself): engine/scheduler.py shares slots by it
    priority: int = 0  # lower is admitted first
    images: list[ImageData] = []  # vision-language models: the prompt's images, in order


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class Call(msgspec.Struct, tag="call", frozen=True):
    call_id: int
    name: str  # one of engine/loop.py's CALLS
    args: list[Any] = []


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


Command = Union[EngineRequest, Abort, Call, Stop]

# ---------------------------------------------------------------------------- engine -> serving process


class SampleDelta(msgspec.Struct):
    """New tokens of sample ``index`` (0..n-1) since its last delta; ``logprobs``: one entry per
    token (``SamplingParams.logprobs`` set); ``finish_reason`` on the sample's last."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


class CachedTokens(msgspec.Struct):
    """Prompt tokens the engine did not compute (hits on its tiers, reads from the pool), and per tier."""

    num_tokens: int
    by_tier: dict[str, int]


class RequestError(msgspec.Struct):
    """Why a request ended without an output: ``kind`` is a key of :data:`ERRORS`."""

    kind: str
    message: str


class FirstTokenStages(msgspec.Struct):
    """Where a request's time in the engine went up to its first token, in seconds, each measured
    on the engine's own clock (durations, so the serving process never compares its clock with
    the engine's): ``queue`` from the engine taking the request to its admission (waiting for
    device room; to the start of its storage prefetch if it had one), ``prefetch`` from that
    start to its admission (None: no prefetch), ``prefill`` from its admission to its first
    token sampled (its tokens' results on the host)."""

    queue: float
    prefill: float
    prefetch: float | None = None


def first_token_stages(metrics: dict[str, float]) -> FirstTokenStages | None:
    """The stages of a request's ``metrics`` (engine/request.py's monotonic times); None if it
    has no first token or admission yet, or its first token came from elsewhere (D of a PD
    hand-off: P's)."""
    arrival, admitted, first = metrics.get("arrival"), metrics.get("admitted"), metrics.get("first_token")
    if arrival is None or admitted is None or first is None or first < admitted:
        return None
    start = metrics.get("prefetch_start")
    if start is None or not arrival <= start <= admitted:
        return FirstTokenStages(admitted - arrival, first - admitted)
    return FirstTokenStages(start - arrival, first - admitted, admitted - start)


class RequestDelta(msgspec.Struct):
    """What one engine iteration says of one request: its samples' new tokens; on its first
    delta the prompt tokens not computed (``cached``) and, P of a hand-off, the manifest's names
    of the blocks on their way (``export``); with its first token where its time in the engine
    went (``stages``); on its last the finished ``output`` (every sample); or only ``error``
    (refused, or the engine stopped)."""

    request_id: str
    samples: list[SampleDelta] = []
    cached: CachedTokens | None = None
    export: dict[str, Any] | None = None
    output: RequestOutput | None = None
    error: RequestError | None = None
    stages: FirstTokenStages | None = None


class CallResult(msgspec.Struct):
    call_id: int
    value: Any = None
    error: str | None = None  # "Type: message" when the call raised


class EngineStatus(msgspec.Struct):
    """Queue lengths after an iteration (``samples_taken``: samples of every request the engine
    took so far, refused ones included: the serving process counts what it sent against it),
    and the pool's health (None: not probed this time)."""

    running: int
    waiting: int
    waiting_samples: int
    samples_taken: int
    pool: dict[str, Any] | None = None


class EngineOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[RequestDelta] = []
    results: list[CallResult] = []
    status: EngineStatus | None = None
    dead: str | None = None  # the engine stopped on this error: nothing more comes

    def __bool__(self) -> bool:
        return bool(self.deltas or self.results or self.status is not None or self.dead is not None)


class EngineInfo(msgspec.Struct):
    """What an engine says of itself once ready."""

    path: str  # its checkpoint directory
    limits: RequestLimits
    pd_on_miss: str
    startup: dict[str, Any]  # engine/startup.py's Startup.as_dict()


class Phase(msgspec.Struct, tag="phase"):
    startup: dict[str, Any]


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class Failed(msgspec.Struct, tag="failed"):
    """The engine could not start: in ``phase``, ``error_type`` (a built-in exception's name is
    raised as such in the serving process: a ValueError is the command's error)."""

    phase: str
    error_type: str
    message: str


EngineMessage = Union[Phase, Ready, Failed, EngineOutputs]

# ---------------------------------------------------------------------------- encoding


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)  # a call's result may hold objects msgpack has no type for: their text


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    raise NotImplementedError(f"no wire form for {kind!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_commands = msgspec.msgpack.Decoder(Command)
_messages = msgspec.msgpack.Decoder(EngineMessage, dec_hook=_dec_hook)


class BadCommand(ValueError):
    """A message the engine cannot take; ``request_id`` names the request it was to add, if any
    (and ``samples`` its n, which the serving process counted as sent)."""

    def __init__(self, message: str, request_id: str | None = None, samples: int = 1) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.samples = samples


def encode(msg: Command | EngineMessage) -> bytes:
    return _encoder.encode(msg)


def decode_command(data: bytes) -> Command:
    """The command in ``data``; BadCommand (with the request's id, when one can be read) if it
    is not one, e.g. an add whose params fail their checks."""
    try:
        return _commands.decode(data)
    except msgspec.MsgspecError as e:
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.MsgspecError:
            raw = None
        if not (isinstance(raw, dict) and raw.get("type") == "add" and isinstance(raw.get("request_id"), str)):
            raise BadCommand(str(e)) from None
        params = raw.get("params")
        n = params.get("n") if isinstance(params, dict) else None
        raise BadCommand(str(e), raw["request_id"], n if isinstance(n, int) and n > 0 else 1) from None


def decode_message(data: bytes) -> EngineMessage:
    return _messages.decode(data)
