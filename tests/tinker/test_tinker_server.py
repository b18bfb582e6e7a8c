"""rlrun.tinker's API front on rank 0 (rlrun.tinker.server), without ranks: the request order per model, resent
requests, refused requests spending their seq_id, one model per job, the sampler versions, and over real HTTP the
key check, long-polled futures and the SDK's error types. The ranks' side is tests/tinker/test_tinker_e2e.py."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_request import ForwardBackwardRequest

import tinker
from helpers import free_port
from rlrun.tinker.calls import Forward, OptimStep, ResetAdapters, Sample, Score, SyncSampler
from rlrun.tinker.http_api import start_server
from rlrun.tinker import server
from rlrun.tinker.server import Front, Futures, Result, Served
from rlrun.tinker.wire import BadRequest
from tinker import types

SERVED = Served("org/tiny", "/nowhere", 0, "Qwen2Config", 64, "/tmp/rlrun-tinker-test", 16)


def _front(lora_rank: int = 0) -> tuple[Front, str]:
    front = Front(Served(**{**SERVED.__dict__, "lora_rank": lora_rank}), api_key=None)
    created = front.create_model(
        {"session_id": "s", "model_seq_id": 0, "base_model": "org/tiny", "type": "create_model"}
        | ({"lora_config": {"rank": lora_rank}} if lora_rank else {})
    )
    return front, created["model_id"]


def _fwd(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1, 1]}
    )
    request = ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _optim(model_id: str, seq_id: int, lr: float = 1e-3) -> dict:
    return {"model_id": model_id, "seq_id": seq_id, "type": "optim_step", "adam_params": {"learning_rate": lr}}


def _queued(front: Front) -> list:
    out = []
    while not front.work.empty():
        out.append(front.work.get_nowait().call)
    return out


def test_requests_run_in_seq_id_order_and_a_resent_one_is_the_same_request() -> None:
    front, model = _front()
    assert model == "s:train:0"  # the SDK computes ids of this form itself when it loads a checkpoint
    second = front.optim_step(_optim(model, 2))["request_id"]  # the SDK sends a split call's first chunk last
    assert _queued(front) == []
    first = front.forward_backward(_fwd(model, 1), None)["request_id"]
    assert [type(c) for c in _queued(front)] == [Forward, OptimStep]
    assert front.optim_step(_optim(model, 2))["request_id"] == second  # a retry: no second step queued
    assert front.forward_backward(_fwd(model, 1), None)["request_id"] == first
    assert _queued(front) == []


def test_a_refused_request_spends_its_seq_id() -> None:
    front, model = _front()
    with pytest.raises(BadRequest, match="loss_fn 'dpo' is unknown"):
        front.forward_backward(_fwd(model, 1, "dpo"), None)
    with pytest.raises(BadRequest, match="learning_rate must be >= 0"):
        front.optim_step(_optim(model, 2, lr=-1.0))
    front.optim_step(_optim(model, 3))
    assert [type(c) for c in _queued(front)] == [OptimStep]  # not left waiting for seq_ids 1 and 2


def test_one_model_per_job_with_the_served_name_and_rank() -> None:
    front = Front(SERVED, api_key=None)
    with pytest.raises(BadRequest, match="'org/other' is not served here; this job serves 'org/tiny'"):
        front.create_model({"session_id": "s", "model_seq_id": 0, "base_model": "org/other"})
    with pytest.raises(BadRequest, match="LoRA rank 8 asked.*--lora_rank 8"):
        front.create_model({"session_id": "s", "model_seq_id": 0, "base_model": "org/tiny", "lora_config": {"rank": 8}})
    front.create_model({"session_id": "s", "model_seq_id": 0, "base_model": "org/tiny"})
    with pytest.raises(BadRequest, match="already trains model s:train:0 .full fine-tuning"):
        front.create_model({"session_id": "t", "model_seq_id": 0, "base_model": "org/tiny"})
    with pytest.raises(BadRequest, match="unknown model_id 'x:train:0'"):
        front.optim_step(_optim("x:train:0", 1))


def test_samplers_sample_the_newest_weights_only() -> None:
    front, model = _front()
    base = front.create_sampling_session({"session_id": "s", "sampling_session_seq_id": 0, "base_model": "org/tiny"})
    prompt = {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}
    params = {"max_tokens": 4, "seed": 7, "stop": [9]}
    asked = {"sampling_session_id": base["sampling_session_id"], "prompt": prompt, "sampling_params": params}
    answer = front.asample({**asked, "num_samples": 3})
    assert len(answer["sample_sequence_ids"]) == 3  # the SDK requires one id per sample
    front.asample({**asked, "num_samples": 3})
    front.save_weights_for_sampler({"model_id": model, "path": "v1", "seq_id": 1})
    first, again, sync = _queued(front)
    assert isinstance(first, Sample) and isinstance(again, Sample) and isinstance(sync, SyncSampler)
    assert first.params.stop_tokens == (9,) and len(set(first.keys)) == 3
    assert again.keys == first.keys  # the same seed draws the same rows
    with pytest.raises(BadRequest, match="samples weights version 0, the engines hold version 1"):
        front.asample(asked)
    path = f"tinker://{model}/sampler_weights/v1"
    newest = front.create_sampling_session({"session_id": "s", "sampling_session_seq_id": 1, "model_path": path})
    front.asample({**asked, "sampling_session_id": newest["sampling_session_id"]})
    with pytest.raises(BadRequest, match="topk_sample_logprobs, top_k"):
        front.asample({**asked, "sampling_session_id": newest["sampling_session_id"], "topk_sample_logprobs": 2,
                       "sampling_params": {**params, "top_k": 5}})
    # what a cookbook recipe asks for under its default stable_reinforce loss: refused with the setting to change
    with pytest.raises(BadRequest, match="record_stability_info .*set loss_fn=importance_sampling"):
        front.asample({**asked, "sampling_session_id": newest["sampling_session_id"], "record_stability_info": True})


def test_compute_logprobs_runs_where_the_trained_model_holds_the_weights() -> None:
    """compute_logprobs (prompt_logprobs, one sample of one token) runs on the trained model: on the newest sampler
    weights before the next step, or with a LoRA job's adapters off for a base-model session; never on weights the
    trained model no longer holds."""
    front, model = _front(lora_rank=8)
    base = front.create_sampling_session({"session_id": "s", "sampling_session_seq_id": 0, "base_model": "org/tiny"})
    ask = {"sampling_session_id": base["sampling_session_id"], "prompt": {"chunks": [{"tokens": [1, 2, 3],
           "type": "encoded_text"}]}, "sampling_params": {"max_tokens": 1, "seed": 3}, "prompt_logprobs": True}
    front.asample(ask)
    front.optim_step(_optim(model, 1))
    front.asample(ask)  # a LoRA job's base: the adapters off
    front.save_weights_for_sampler({"model_id": model, "sampling_session_seq_id": 1, "seq_id": 2})
    newest = next(sid for sid, session in front.samplers.items() if session.version == 1)
    front.asample({**ask, "sampling_session_id": newest})
    front.optim_step(_optim(model, 3))
    with pytest.raises(BadRequest, match="compute_logprobs on weights version 1: the trained model no longer"):
        front.asample({**ask, "sampling_session_id": newest})
    with pytest.raises(BadRequest, match="num_samples 1, max_tokens 1"):
        front.asample({**ask, "sampling_params": {"max_tokens": 4}})
    scores = [c for c in _queued(front) if isinstance(c, Score)]
    assert [s.base for s in scores] == [False, True, False]
    # a LoRA job starts a fresh model by putting its adapters back
    again = front.create_model({"session_id": "t", "model_seq_id": 0, "base_model": "org/tiny",
                                "lora_config": {"rank": 8}})
    assert again["model_id"] == "t:train:0" and isinstance(_queued(front)[-1], ResetAdapters)
    with pytest.raises(BadRequest, match="replaced by a later"):
        front.optim_step(_optim(model, 4))


def _post(port: int, route: str, body: dict, key: str = "tml-right") -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v1/{route}",
        data=json.dumps(body).encode(),
        headers={"X-API-Key": key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_key_futures_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SDK against the front, with a thread in place of the ranks that answers every queued call at once
    (the stand-in is only for the ranks: the HTTP server, validation and futures are rlrun's)."""
    port = free_port()
    front = Front(SERVED, api_key="tml-right")
    server = start_server(front, "127.0.0.1", port, 1 << 20)

    def ranks() -> None:
        while True:
            pending = front.work.get()
            front.futures.resolve(pending.request_id, Result(body=b'{"type": "optim_step", "metrics": {}}'))

    threading.Thread(target=ranks, daemon=True).start()
    try:
        assert _post(port, "client/config", {}, key="tml-wrong")[0] == 401
        monkeypatch.setenv("TINKER_API_KEY", "tml-wrong")
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}").create_lora_training_client("org/tiny", rank=0).result()
        monkeypatch.setenv("TINKER_API_KEY", "tml-right")
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
        with pytest.raises(tinker.BadRequestError, match="LoRA rank 4 asked"):
            service.create_lora_training_client("org/tiny", rank=4).result()
        training = service.create_lora_training_client("org/tiny", rank=0).result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        # a finished future fetched twice gives the same answer; an unknown one is a 404
        created = _post(port, "create_sampling_session", {"session_id": "x", "sampling_session_seq_id": 0})
        assert created[0] == 200
        status, first = _post(port, "optim_step", _optim(training.model_id, 2))  # the SDK sent seq_id 1
        assert status == 200
        again = [_post(port, "retrieve_future", {"request_id": first["request_id"]}) for _ in range(2)]
        assert again[0] == again[1] == (200, {"type": "optim_step", "metrics": {}})
        assert _post(port, "retrieve_future", {"request_id": "req-x"})[0] == 404
        assert _post(port, "nowhere", {})[0] == 404
        capabilities = tinker.RestClient(base_url=f"http://127.0.0.1:{port}").get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == ["org/tiny"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_job_waits_until_its_failed_futures_are_fetched() -> None:
    """The failure path's drain (job.Serving waits on it before the process leaves): it returns as soon as every
    failed future was fetched and a client's telemetry (the SDK's report of the failure, which it sends before it
    raises) came after, and after its bounds when one never is; a future resolved normally does not hold it."""
    futures = Futures()
    done, failed, never = futures.create(), futures.create(), futures.create()
    futures.resolve(done, Result(body=b"{}"))
    futures.fail_pending("rlrun.tinker stopped: rank 1 failed")
    assert futures.wait(failed, 0)
    drained = threading.Event()
    waiter = threading.Thread(target=lambda: (futures.drain_failures(30), drained.set()))
    waiter.start()
    assert not drained.wait(0.3)  # `never` is still unfetched
    assert futures.wait(never, 0).error == "rlrun.tinker stopped: rank 1 failed"
    assert not drained.wait(0.3)  # fetched, but the SDK's report of it has not come yet
    futures.reported()
    assert drained.wait(5)
    waiter.join()
    other = Futures()
    other.create()
    other.fail_pending("stopped")
    other.drain_failures(0.05)  # nobody fetches: returns at its bound


def test_a_fetched_result_is_dropped_after_its_keep_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long session does not hold every answer: a result fetched once stays fetchable for KEEP_DELIVERED_S (a
    retried poll), then the next request drops it; a result not fetched yet is kept."""
    futures = Futures()
    fetched, unfetched = futures.create(), futures.create()
    futures.resolve_all({fetched: Result(body=b"1"), unfetched: Result(body=b"2")})
    assert futures.wait(fetched, 0).body == b"1"
    futures.create()
    assert futures.wait(fetched, 0).body == b"1"  # within its keep time: fetched again
    monkeypatch.setattr(server, "KEEP_DELIVERED_S", 0.0)
    futures.create()
    with pytest.raises(KeyError):
        futures.wait(fetched, 0)
    assert futures.wait(unfetched, 0).body == b"2"
