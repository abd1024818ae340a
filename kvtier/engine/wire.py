"""Messages between a serving process and its engine process (engine/client.py, engine/proc.py):
msgpack (msgspec) over two ZeroMQ sockets, one each way. Each message is a list whose first item
names it::

    server -> engine   ["add", request_id, prompt_token_ids, params, cache_salt, handoff, export, owner, priority]
                       ["abort", request_id]    ["call", call_id, name, args]    ["stop"]
    engine -> server   ["phase", startup]  ["ready", info]  ["failed", phase, error_type, message]
                       ["delta", request_id, index, token_ids, finish_reason, logprobs, export, output, cached]
                       ["error", request_id, kind, message]      kind: value | queue | dead | internal
                       ["result", call_id, error, value]
                       ["status", running, waiting, waiting_samples, samples_taken, pool_health]
                       ["batch", [message, ...]]   what one iteration of the engine loop said

Arrays (MoE routing in an output) travel as ``["ndarray", dtype, shape, bytes]``; other objects a
result holds that msgpack has no type for are sent as their ``str``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np

from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return ["ndarray", obj.dtype.str, list(obj.shape), obj.tobytes()]
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder()


def encode(msg: list) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> list:
    return _decoder.decode(data)


def add_message(req: Request) -> list:
    """The "add" message of a request the serving process made (engine/client.py)."""
    p = params_to_wire(req.params)
    return ["add", req.request_id, req.prompt_token_ids, p, req.cache_salt, req.handoff, req.export, req.owner, req.priority]


def params_to_wire(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def _array(v: Any) -> np.ndarray | None:
    if v is None:
        return None
    _, dtype, shape, data = v
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def output_to_wire(out: RequestOutput) -> dict:
    d = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    d["outputs"] = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)} for c in out.outputs]
    return d


def output_from_wire(d: dict) -> RequestOutput:
    outputs = [CompletionOutput(**(c | {"routed_experts": _array(c["routed_experts"])})) for c in d["outputs"]]
    return RequestOutput(**(d | {"routed_experts": _array(d["routed_experts"]), "outputs": outputs}))
