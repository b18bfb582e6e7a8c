"""Run by test_vllm_in_process.py under the lane's python with torchrun (every rank builds one InProcessEngine).

argv[1] = tensor parallel size T. Each rank: build the in-process engine (colocate-all layout over the whole
world), then for three rounds (initial weights; one optimizer step of an "actor" copy, written in place as
colocated WeightSync does; another step written into new buffers) check that the engine's greedy output equals
the actor's HF greedy output and that the engine's sampled-token log-probs equal the actor's teacher-forced
log-probs. Also: host RNG states and torch.set_num_threads survive vLLM, same seeds give the same samples, and
timings. Prints one JSON line per rank.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from vllm_weights_check import hf_greedy, hf_token_log_probs


def train_step(actor: torch.nn.Module, rows: list[list[int]], lr: float) -> None:
    """One SGD step of next-token loss on `rows` (a stand-in for a PPO update: it changes every weight)."""
    actor.train()
    opt = torch.optim.SGD(actor.parameters(), lr=lr)
    for row in rows:
        ids = torch.tensor([row])
        loss = actor(input_ids=ids, labels=ids).loss
        loss.backward()
    opt.step()
    opt.zero_grad()
    actor.eval()


def main() -> None:
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.vllm.engine import VLLMOptions
    from rlrun.engines.vllm.in_process import InProcessEngine
    from rlrun.launch.groups import build_groups
    from rlrun.strategies.blocks import param_blocks
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat
    from rlrun.launch.layout import LayoutRequest
    from rlrun.plan.placement import plan_layout
    from rlrun.launch.transfer import EngineRowExchange
    from rlrun.models.tiny import EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config

    tp = int(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = plan_layout(LayoutRequest(need_critic=False, need_ref=False, need_reward=False, colocate_all_models=True,
                                       vllm_tensor_parallel_size=tp), world, world)
    groups = build_groups(layout, 240)
    index = layout.engine_index_of(rank)
    exchange = EngineRowExchange(groups.get(f"engine.{index}"), torch.device("cpu"))
    tok = build_byte_tokenizer()
    actor = build_causal_lm(tiny_model_config(), seed=3)
    engine_model = copy.deepcopy(actor)
    max_new = 24
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=max_new, pad_id=PAD_ID, end_ids=(EOS_ID,))
    # host RNG state before vLLM: it must be the same after construction
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    before = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    real_set_num_threads = torch.set_num_threads
    t0 = time.perf_counter()
    engine = InProcessEngine(engine_model, tok, greedy, torch.device("cpu"), VLLMOptions(rank, 0, 128, tp),
                             layout=layout, world_size=world, exchange=exchange)
    # What the trainer builds for a colocated layout: the engine is weight sync's loader and keeps no copy
    sync = build_weight_sync(actor_params=ParamSource(actor, param_blocks), receiver=engine.weights, route=Route(colocated=True), wire=WireFormat(bucket_bytes=2 ** 20, dtype=torch.float32), device=torch.device('cpu'))
    report_meta = all(p.is_meta for p in engine.model.parameters())
    report: dict[str, object] = {"rank": rank, "tp": tp, "start_s": engine.start_s,
                                 "construct_s": time.perf_counter() - t0, "engine_on_meta": report_meta}
    after = (random.random(), float(np.random.rand()), float(torch.rand(())))
    report["rng_kept"] = before == after
    report["set_num_threads_kept"] = torch.set_num_threads is real_set_num_threads
    # Each rank asks its own prompts (with tensor parallel, the peers' rows are different ones)
    prompts = [list(f"Write {rank * 8 + i} digits:".encode()) for i in range(6)]
    checks = []
    for round_ in range(3):
        if round_ > 0:
            # the same step on every rank, as a data-parallel actor's synced update (tensor parallel peers must agree)
            train_step(actor, [list(f"Step {round_} text:".encode()), list(b"0123456789")], lr=0.5)
        if round_ == 2:
            with torch.no_grad():  # the actor's parameters in new memory: the sync reads them wherever they are
                for p in actor.parameters():
                    p.data = p.data.clone()
        sync.sync()  # each parameter straight into vLLM's reload
        engine.load_weights()
        sync_s = engine.last_sync_s
        engine.sampling = greedy
        out = engine.sample(prompts, seed=11)
        want = hf_greedy(actor, prompts, max_new, EOS_ID)
        engine.sampling = SamplingSettings(1.0, 1.0, max_new, PAD_ID, (EOS_ID,))
        sampled = engine.sample(prompts, seed=11)
        again = engine.sample(prompts, seed=11)
        other = engine.sample(prompts, seed=12)
        lp_diff = max(abs(a - b) for p, r, lps in zip(prompts, sampled.responses, sampled.log_probs)
                      for a, b in zip(lps, hf_token_log_probs(actor, p, r, 1.0)))
        checks.append({"round": round_, "greedy_equal": out.responses == want, "greedy_first": out.responses[0],
                       "max_logprob_diff": lp_diff, "sync_s": sync_s, "rows": len(out.responses),
                       "lengths_match": all(len(r) == len(l) for r, l in zip(sampled.responses, sampled.log_probs)),
                       "repeat_same_samples": again.responses == sampled.responses and again.log_probs == sampled.log_probs,
                       "other_seed_differs": other.responses != sampled.responses})
    report["checks"] = checks
    engine.close()
    # the trainer's collectives still work after vLLM left, and the default group goes cleanly after it
    flag = torch.tensor([1.0])
    dist.all_reduce(flag)
    report["all_reduce_after_close"] = float(flag)
    dist.destroy_process_group()
    # One write(2) per line: both ranks share the pipe, and print() may hand the text and its newline to the pipe
    # separately, interleaving the two ranks' lines (seen once). A write under PIPE_BUF bytes is atomic.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
