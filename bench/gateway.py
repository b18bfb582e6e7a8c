"""Rollouts through the token gateway vs the same engine called in process (issue 62's target: >= 0.9x tokens/s).

    .venv/bin/python bench/gateway.py                  # 5 rounds, 64 prompts x 64 new tokens
    .venv/bin/python bench/gateway.py --rounds 3 --prompts 32 --new 32

One rlrun native engine (a 4-layer, 256-wide Qwen2 over the byte tokenizer, fp32, CPU) samples the same prompts two
ways, alternating, in one invocation:
  * in process: one `engine.sample` call over every prompt (what rlrun's own rollouts do);
  * gateway: every prompt its own HTTP client thread, all sent at once to POST /inference/v1/generate (vLLM's
    token route, as verifiers calls it), the rank's thread serving them until all are answered.
Reported: median seconds and generated tokens per second of each, and their ratio (gateway / in process), medians
over the rounds; the engine calls the gateway made per round. Same draws both ways (each request keyed by its
index), so both sample the same tokens: the ratio is the gateway's overhead (HTTP, JSON, batching), not the work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request

import torch
from transformers import Qwen2Config

from rlrun.engines.native.engine import NativeEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.gateway.server import Gateway
from rlrun.gateway.wire import Limits
from rlrun.models.tiny import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm


def engine(new: int) -> NativeEngine:
    cfg = Qwen2Config(vocab_size=BYTE_VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, pad_token_id=PAD_ID,
                      eos_token_id=EOS_ID)
    # EOS never sampled: every row runs to the cap, so both ways generate the same number of tokens
    settings = SamplingSettings(1.0, 1.0, new, PAD_ID, (-1,))
    return NativeEngine(build_causal_lm(cfg, seed=0).eval(), settings, torch.device("cpu"), build_byte_tokenizer())


def in_process(eng: NativeEngine, prompts: list[list[int]], new: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = eng.sample(prompts, 1, max_new_tokens=new, keys=list(range(len(prompts))))
    return time.perf_counter() - t0, sum(len(r) for r in out.responses)


def through_gateway(eng: NativeEngine, prompts: list[list[int]], new: int) -> tuple[float, int, int]:
    gateway = Gateway(Limits("bench", 1.0, 1.0, new, 512), build_byte_tokenizer(), answer_timeout=300)
    sessions = [gateway.open_session() for _ in prompts]  # session k's first call: key k x CALL_KEYS
    tokens = [0] * len(prompts)

    def client(k: int) -> None:
        body = json.dumps({"model": "bench", "token_ids": prompts[k],
                           "sampling_params": {"max_tokens": new, "logprobs": 1}}).encode()
        request = urllib.request.Request(sessions[k].base_url.removesuffix("/v1") + "/inference/v1/generate",
                                         data=body, headers={"Authorization": f"Bearer {gateway.token}"})
        with urllib.request.urlopen(request, timeout=300) as response:
            tokens[k] = len(json.loads(response.read())["choices"][0]["token_ids"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    gateway.serve(eng, 1, 0, until=lambda: not any(t.is_alive() for t in threads))
    seconds = time.perf_counter() - t0
    for t in threads:
        t.join()
    gateway.close()
    return seconds, sum(tokens), gateway.batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    eng = engine(args.new)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    in_process(eng, prompts[:4], 4)  # warm-up
    rows = []
    for r in range(args.rounds):
        direct_s, direct_tokens = in_process(eng, prompts, args.new)
        gate_s, gate_tokens, batches = through_gateway(eng, prompts, args.new)
        rows.append((direct_s, direct_tokens / direct_s, gate_s, gate_tokens / gate_s, batches))
        print(f"round {r + 1}: in process {direct_s:.2f} s ({direct_tokens / direct_s:.0f} tok/s), gateway {gate_s:.2f} s "
              f"({gate_tokens / gate_s:.0f} tok/s, {batches} engine calls)", flush=True)
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"median of {args.rounds}: in process {med[0]:.2f} s / {med[1]:.0f} tok/s; gateway {med[2]:.2f} s / "
          f"{med[3]:.0f} tok/s; ratio (gateway / in process) {med[3] / med[1]:.2f}; engine calls per round "
          f"{med[4]:.0f}")


if __name__ == "__main__":
    main()
