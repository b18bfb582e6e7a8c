"""rlrun.tinker's wire formats against the SDK's own encoders and decoders (tinker 0.38): a forward_backward body
the SDK writes (plain or zstd) reads back exactly; the results rlrun writes decode with the SDK's
response decoders; what rlrun does not run is refused with one line naming it."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types.forward_backward_request import ForwardBackwardRequest

from rlrun.tinker.policy import Passed
from rlrun.tinker.wire import BadRequest, Sampled, forward_backward_output, read_forward_backward, sample_response
from tinker import types


def _body(data: list[types.Datum], loss_fn: str = "cross_entropy", config: dict | None = None, **kw) -> bytes:
    request = ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=3,
        **kw,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_forward_backward_bodies_read_back_exactly() -> None:
    weights = types.TensorData.from_numpy(np.array([0.0, 0.0, 1.0, 0.5], dtype=np.float32))
    d = _datum([1, 2, 3, 4], target_tokens=[2, 3, 4, 5], weights=weights)
    body = _body([d, _datum([7], target_tokens=[8], weights=[1.0])])
    read = read_forward_backward(body, None, max_len=16)
    assert (read.model_id, read.seq_id, read.loss_fn, read.backward) == ("s:train:0", 3, "cross_entropy", True)
    assert read.data[0].tokens == [1, 2, 3, 4]
    assert read.data[0].inputs == {"target_tokens": [2, 3, 4, 5], "weights": [0.0, 0.0, 1.0, 0.5]}
    assert read.data[1].inputs["target_tokens"] == [8]
    # the client's zstd frame (ClientConfigResponse.proto_compress_fwdbwd) reads the same
    assert read_forward_backward(zstandard.ZstdCompressor().compress(body), "zstd", 16) == read


def test_config_reads_from_v2_and_defaults_apply() -> None:
    rl = _datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -2.0], advantages=[1.0, 1.0])
    read = read_forward_backward(_body([rl], "ppo", {"clip_high_threshold": 1.5}), None, 16)
    assert read.config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5}
    with pytest.raises(BadRequest, match="text"):
        read_forward_backward(_body([rl], "ppo", {"clip_high_threshold": "wide"}), None, 16)


@pytest.mark.parametrize(
    ("loss_fn", "inputs", "message"),
    [
        ("stable_reinforce", {"target_tokens": [2]}, "stable_reinforce is not supported.*loss_fn=importance_sampling"),
        ("custom", {"target_tokens": [2]}, "forward_backward_custom"),
        ("ppo", {"target_tokens": [2], "logprobs": [0.0]}, r"needs loss_fn_inputs \['advantages'\]"),
        ("cross_entropy", {"target_tokens": [2], "weights": [1.0, 1.0]}, "has 2 values for 1 input tokens"),
    ],
)
def test_refused_requests_say_why(loss_fn: str, inputs: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        read_forward_backward(_body([_datum([1], **inputs)], loss_fn), None, 16)


def test_other_refusals() -> None:
    ok = {"target_tokens": [2, 3], "weights": [1.0, 1.0]}
    with pytest.raises(BadRequest, match="exceed --max_len 1"):
        read_forward_backward(_body([_datum([1, 2], **ok)]), None, max_len=1)
    two_d = types.TensorData.from_numpy(np.ones((2, 3), dtype=np.float32))
    with pytest.raises(BadRequest, match=r"shape \[2, 3\]"):
        read_forward_backward(_body([_datum([1, 2], target_tokens=[2, 3], weights=two_d)]), None, 16)
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=1)
    with_image = types.Datum(model_input=types.ModelInput(chunks=[image]), loss_fn_inputs=ok)
    with pytest.raises(BadRequest, match="image chunks are not supported"):
        read_forward_backward(_body([with_image]), None, 16)
    with pytest.raises(BadRequest, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff", None, 16)
    with pytest.raises(BadRequest, match="Content-Encoding 'br'"):
        read_forward_backward(b"", "br", 16)


def test_results_decode_with_the_sdk() -> None:
    passed = Passed(log_probs=[[-1.5, -0.25], [-3.0]], losses=[1.75, 3.0])
    out = deserialize_forward_backward_output(forward_backward_output(passed))
    assert out.metrics == {"loss:sum": 4.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.5, -0.25], [-3.0]]
    sampled = [Sampled([5, 6], [-0.5, -1.0], stopped=True), Sampled([7], [-2.0], stopped=False)]
    response = deserialize_sample_response(sample_response(sampled))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([5, 6], [-0.5, -1.0], "stop"),
        ([7], [-2.0], "length"),
    ]
