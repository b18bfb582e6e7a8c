"""Tinker's wire formats, read and written with the SDK's own types: the JSON bodies validate as its pydantic
request models, forward_backward arrives as its protobuf ForwardBackwardRequest (zstd when the client compresses),
and forward_backward's and sample's results leave as its protobuf ForwardBackwardOutput / SampleResponse (the SDK
refuses them as JSON). What rlrun does not run is refused here, on rank 0, before any rank sees it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
import zstandard
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto  # the SDK's own inverse of its request encoder

from rlrun.runtime.errors import RlrunError
from rlrun.tinker.losses import LOSSES, LossInputError, check_inputs, loss_config
from rlrun.tinker.policy import Datum, Passed

M = TypeVar("M", bound=pydantic.BaseModel)

# Losses the SDK names that rlrun does not compute, and why (answered as a user error on the future).
UNSUPPORTED_LOSSES = {
    "stable_reinforce": (
        "its objective is not published and it trains on the sampler's stability records, which rlrun's engines do "
        "not keep: train with loss_fn=importance_sampling, ppo or cispo (the cookbook's loss_fn setting)"
    ),
    "custom": "server-side custom losses are not supported; forward_backward_custom (client-side) works",
}


class BadRequest(RlrunError):
    """A request rlrun refuses (HTTP 400 with this message, or a failed future of category "user")."""


def parse(model: type[M], body: Mapping[str, Any]) -> M:
    """`body` validated as the SDK's request model `model`; its first error as one BadRequest line."""
    try:
        return model.model_validate(dict(body))
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"{model.__name__}: {where}: {first['msg']}") from None


@dataclass(frozen=True)
class ForwardBackward:
    """A forward_backward (or forward, `backward` False) request as rank 0 read it."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float]
    backward: bool


def read_forward_backward(body: bytes, encoding: str | None, max_len: int) -> ForwardBackward:
    """The protobuf body of POST /forward_backward (zstd-compressed when `encoding` says so), checked."""
    return checked_forward_backward(unpack_forward_backward(body, encoding), max_len)


def unpack_forward_backward(body: bytes, encoding: str | None) -> pb.ForwardBackwardRequest:
    """The message, not yet checked (its model and seq_id name the request a refusal spends)."""
    if encoding == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
        except zstandard.ZstdError as exc:
            raise BadRequest(f"forward_backward: the zstd body does not decompress ({exc})") from None
    elif encoding not in (None, "", "identity"):
        raise BadRequest(f"forward_backward: Content-Encoding {encoding!r} is not supported (zstd or none)")
    try:
        return pb.ForwardBackwardRequest.FromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
        raise BadRequest(f"forward_backward: the body is not a ForwardBackwardRequest ({exc})") from None


def checked_forward_backward(msg: pb.ForwardBackwardRequest, max_len: int) -> ForwardBackward:
    """The request as the ranks run it: a loss rlrun computes, its config and every datum's inputs checked."""
    name = msg.loss_fn
    if name in UNSUPPORTED_LOSSES:
        raise BadRequest(f"loss_fn {name} is not supported by rlrun.tinker: {UNSUPPORTED_LOSSES[name]}")
    if name not in LOSSES:
        raise BadRequest(f"loss_fn {name!r} is unknown; rlrun.tinker computes {', '.join(LOSSES)}")
    try:
        config = loss_config(name, _loss_config(msg))
        data = [_datum(d, name, i, max_len) for i, d in enumerate(msg.data)]
    except LossInputError as exc:
        raise BadRequest(str(exc)) from None
    if not data:
        raise BadRequest("forward_backward: no data")
    return ForwardBackward(msg.model_id, msg.seq_id, data, name, config, backward=not msg.forward_only)


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    """loss_fn_config_v2 (every entry) where the client sent it, else the legacy numeric map."""
    if not msg.loss_fn_config_v2:
        return dict(msg.loss_fn_config)
    out = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise LossInputError(f"loss_fn_config[{key!r}] is text; the built-in losses take numbers")
        out[key] = value.number
    return out


def _datum(d: pb.Datum, loss_fn: str, index: int, max_len: int) -> Datum:
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise LossInputError(f"datum {index}: {kind} chunks are not supported (text policies only)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    if not tokens:
        raise LossInputError(f"datum {index}: the model input is empty")
    if len(tokens) > max_len:
        raise LossInputError(f"datum {index}: {len(tokens)} tokens exceed --max_len {max_len}")
    inputs: dict[str, list[float]] = {}
    for key, tensor in d.loss_fn_inputs.items():
        try:
            array = _tensor_data_from_proto(tensor).to_numpy()
        except ValueError as exc:
            raise LossInputError(f"datum {index}: loss_fn_inputs[{key!r}]: {exc}") from None
        if array.ndim != 1:
            raise LossInputError(
                f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(array.shape)}; rlrun.tinker takes one "
                "value per input token (top-k distillation targets are not supported)"
            )
        inputs[key] = array.tolist()
    check_inputs(loss_fn, set(inputs), len(tokens), {k: len(v) for k, v in inputs.items()}, index)
    return Datum(tokens, inputs)


def forward_backward_output(passed: Passed) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord with each datum's `logprobs`, and `loss:sum`."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(passed.log_probs))
    field = record.fields["logprobs"]
    arrays = [np.asarray(lp, dtype=np.float32) for lp in passed.log_probs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    out.metrics["loss:sum"] = passed.loss_sum
    return bytes(out.SerializeToString())


@dataclass(frozen=True)
class Sampled:
    """One sampled sequence: its tokens, their log-probs, and whether it stopped (else it hit max_tokens)."""

    tokens: list[int]
    log_probs: list[float]
    stopped: bool


def sample_response(sequences: Sequence[Sampled], prompt_log_probs: Sequence[float] | None = None) -> bytes:
    """SampleResponse; `prompt_log_probs`: the prompt's tokens after the first (the first has none: NaN, which the
    SDK reads as None)."""
    out = pb.SampleResponse()
    if prompt_log_probs is not None:
        out.prompt_logprobs = np.asarray([np.nan, *prompt_log_probs], dtype=np.float32).tobytes()
    for s in sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(s.log_probs, dtype=np.float32).tobytes(),
        )
    return bytes(out.SerializeToString())
