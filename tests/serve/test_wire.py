"""The messages between a serving process and its engine (engine/wire.py): what leaves one side
arrives on the other as it left, typed (no positional lists), and a message the engine cannot
take still names the request it was for, so that its caller gets an error instead of waiting."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

import kvtier
from kvtier.engine.outputs import CompletionOutput, RequestOutput
from kvtier.engine.wire import (
    Abort,
    BadCommand,
    CachedTokens,
    Call,
    CallResult,
    Command,
    EngineOutputs,
    EngineRequest,
    EngineStatus,
    RequestDelta,
    SampleDelta,
    Stop,
    decode_command,
    decode_message,
    encode,
)


def test_every_command_arrives_as_it_left():
    params = kvtier.SamplingParams(max_tokens=3, n=2, stop=("end",), stop_token_ids=[7, 7, 9], seed=5, logprobs=2)
    sent: list[Command] = [
        EngineRequest("r-1", [1, 2, 3], params, "salt", None, False, "cmpl-1", -3),
        EngineRequest("r-2", [4], kvtier.SamplingParams(), handoff={"first_token": 5, "keys": ["k"], "num_tokens": 1}),
        Abort("r-1"),
        Call(7, "kv_events", [12]),
        Stop(),
    ]
    got = [decode_command(encode(m)) for m in sent]
    assert got == sent
    assert isinstance(got[0], EngineRequest)
    assert got[0].params == params and got[0].params.stop_set == {7, 9}  # checked and made again on arrival


def test_an_add_whose_params_fail_their_checks_is_refused_by_name():
    """Such an add cannot be decoded, but the engine can still answer its request (and count its samples)."""
    raw = {"type": "add", "request_id": "r-9", "prompt_token_ids": [1], "params": {"max_tokens": 0, "n": 3}}
    with pytest.raises(BadCommand, match="max_tokens must be an int >= 1, got 0") as e:
        decode_command(msgspec.msgpack.encode(raw))
    assert (e.value.request_id, e.value.samples) == ("r-9", 3)
    with pytest.raises(BadCommand) as e:
        decode_command(msgspec.msgpack.encode({"type": "nonsense"}))
    assert e.value.request_id is None


def test_an_iteration_s_outputs_arrive_as_they_left_routing_arrays_included():
    routed = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2)
    sample = CompletionOutput(0, [11, 12], "ab", "length", routed, [{11: -0.5, 3: -1.5}, {12: -0.25}])
    output = RequestOutput(
        "r-1", [1, 2], [11, 12], "ab", "length", 1, {"device": 1}, routed, {"arrival": 1.0}, None, None, None, [sample]
    )
    sent = EngineOutputs(
        deltas=[
            RequestDelta("r-1", [SampleDelta(0, [12], [{12: -0.25}], "length")], output=output),
            RequestDelta("r-2", [SampleDelta(1, [4, 5])], cached=CachedTokens(16, {"device": 16})),
        ],
        results=[CallResult(3, {"seq": 3, "events": [("stored", 7)]})],
        status=EngineStatus(1, 2, 3, 4, {"ok": True}),
    )
    got = decode_message(encode(sent))
    assert isinstance(got, EngineOutputs)
    out = got.deltas[0].output
    assert out is not None and out.routed_experts is not None
    np.testing.assert_array_equal(out.routed_experts, routed)
    assert out.routed_experts.dtype == np.int16 and out.outputs[0].logprobs == sample.logprobs
    assert got.deltas[1] == sent.deltas[1] and got.status == sent.status
    assert got.results[0].value == {"seq": 3, "events": [["stored", 7]]}  # (msgpack has lists, not tuples)


def test_a_requests_images_cross_the_wire_bit_for_bit():
    from kvtier.engine.wire import EngineRequest, decode_command, encode, image_data, mm_input
    from kvtier.model.images import MMInput, image_hash

    pixels = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
    image = MMInput(image_hash(pixels), 5, 16, pixels)
    sent = EngineRequest("r", [1, 2], kvtier.SamplingParams(), images=[image_data(image)])
    got = decode_command(encode(sent))
    assert isinstance(got, EngineRequest) and len(got.images) == 1
    back = mm_input(got.images[0])
    assert (back.hash, back.offset, back.length) == (image.hash, 5, 16) and np.array_equal(back.pixels, pixels)
    with pytest.raises(ValueError, match="image pixels of 12 bytes do not make float32 \\[3, 8, 8\\]"):
        mm_input(msgspec.structs.replace(got.images[0], pixels=b"\0" * 12))
    # other pixels under this image's hash: refused, or they would answer for it in every tier
    other = (pixels + 1).astype(np.float32)
    with pytest.raises(ValueError, match="hash is not the hash of its pixels"):
        mm_input(msgspec.structs.replace(got.images[0], pixels=other.tobytes()))
