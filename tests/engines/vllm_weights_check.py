"""Run by test_vllm_child.py under the lane's python: one VLLMEngine (child process) on the tiny model.

Checks, after each weight sync (WeightSync with the engine's sink, the actor updated in place, then moved to new
memory), that vLLM's greedy output equals HF greedy generate on the same weights and that vLLM's sampled-token log-probs equal HF
teacher-forced log-probs. Prints one JSON line with the measurements.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def hf_token_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [r, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def hf_greedy(model, prompts: list[list[int]], max_new: int, eos: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding, exactly what vLLM computes
            seq = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos)
            row = seq[0, len(p):].tolist()
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def main() -> None:
    import copy

    import torch.distributed as dist

    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.vllm.engine import VLLMEngine, VLLMOptions, request_seeds
    from rlrun.strategies.blocks import param_blocks
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat
    from rlrun.models.tiny import EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # WeightSync asks the rank
    tok = build_byte_tokenizer()
    model = build_causal_lm(tiny_model_config(), seed=3)
    prompts = [list(f"Write {i} digits:".encode()) for i in range(8)]
    max_new = 24
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=max_new, pad_id=PAD_ID, end_ids=(EOS_ID,))
    engine = VLLMEngine(copy.deepcopy(model), tok, greedy, torch.device("cpu"), VLLMOptions(0, 0, 128, timeout_s=300))
    # The trainer's sync as it is for an engine on the actor's own rank: `model` stands for the actor, and each sync
    # goes bucket by bucket (small buckets: several) through the engine's sink to the child; the rank keeps no copy.
    sync = build_weight_sync(actor_params=ParamSource(model, param_blocks), receiver=engine.weights, route=Route(colocated=True), wire=WireFormat(bucket_bytes=2 ** 16, dtype=torch.float32), device=torch.device('cpu'))
    engine.child.wait_ready()
    report: dict[str, object] = {"start_s": engine.start_s, "checks": [], "buckets": sync.num_buckets,
                                 "engine_on_meta": all(p.is_meta for p in engine.model.parameters())}
    gen = torch.Generator().manual_seed(7)
    for round_ in range(3):
        if round_ == 1:  # a sync that writes in place (colocated WeightSync)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        if round_ == 2:  # the actor's parameters in new memory: the sync reads them wherever they are
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.clone() + torch.randn(p.shape, generator=gen) * 0.2
        sync.sync()
        engine.load_weights()  # what the trainer does after every weight sync
        engine.sampling = greedy
        t0 = time.perf_counter()
        out = engine.sample(prompts, seed=11)
        total = time.perf_counter() - t0
        want = hf_greedy(model, prompts, max_new, EOS_ID)
        engine.sampling = SamplingSettings(1.0, 1.0, max_new, PAD_ID, (EOS_ID,))
        sampled = engine.sample(prompts, seed=11)
        again = engine.sample(prompts, seed=11)
        lp_diff = max(abs(a - b) for p, r, lps in zip(prompts, sampled.responses, sampled.log_probs)
                      for a, b in zip(lps, hf_token_log_probs(model, p, r, 1.0)))
        report["checks"].append({  # type: ignore[union-attr]
            "round": round_, "greedy_equal": out.responses == want, "greedy_first": out.responses[0],
            "hf_first": want[0], "max_logprob_diff": lp_diff, "sync_s": engine.last_sync_s, "generate_s": total,
            "lengths_match": all(len(r) == len(l) for r, l in zip(sampled.responses, sampled.log_probs)),
            "repeat_same_samples": again.responses == sampled.responses and again.log_probs == sampled.log_probs,
        })
    # Multi-turn agents: a per-call token cap and stop strings. Greedy, with a stop string taken from the greedy
    # answer itself (its first printable ASCII byte), so vLLM must end that row exactly where rlrun's rule does.
    from rlrun.engines.protocol import cut_at_stop

    engine.sampling = greedy
    full = engine.sample(prompts, seed=5).responses
    printable = [t for t in full[0] if 32 < t < 127]
    stop = (chr(printable[0]),) if printable else ("\n",)
    cut = engine.sample(prompts, seed=5, max_new_tokens=10, stop=stop)
    report["stop"] = {
        "stop": stop[0], "found_in_row0": bool(printable),
        "max_len": max(map(len, cut.responses)),
        "rows_as_rule": all(r == cut_at_stop(f[:10], stop, tok) for r, f in zip(cut.responses, full)),
        "lengths_match": all(len(r) == len(l) for r, l in zip(cut.responses, cut.log_probs)),
    }
    # --vllm_seeded_requests: each row's sample depends on its own seed only (alone, or in a reversed batch, it comes
    # out the same); without it, one seed per call: repeatable, but a row alone is sampled from other noise.
    engine.sampling = SamplingSettings(1.0, 1.0, max_new, PAD_ID, (EOS_ID,))
    seeds = request_seeds(21, len(prompts))
    unseeded = engine.sample_seeded(prompts, seeds).responses
    unseeded_again = engine.sample_seeded(prompts, seeds).responses
    unseeded_solo = [engine.sample_seeded([p], [s]).responses[0] for p, s in zip(prompts, seeds)]
    engine.seeded_requests = True
    batched = engine.sample_seeded(prompts, seeds).responses
    report["seeded"] = {
        "solo_equal": [engine.sample_seeded([p], [s]).responses[0] for p, s in zip(prompts, seeds)] == batched,
        "reversed_equal": engine.sample_seeded(prompts[::-1], seeds[::-1]).responses[::-1] == batched,
        "unseeded_repeat_equal": unseeded_again == unseeded,
        "unseeded_solo_rows_equal": sum(a == b for a, b in zip(unseeded_solo, unseeded)),
    }
    engine.seeded_requests = False
    engine.close()
    report["child_exitcode"] = engine.child.proc.exitcode
    dist.destroy_process_group()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
