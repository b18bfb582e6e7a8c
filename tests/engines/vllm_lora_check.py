"""Run by test_vllm_child.py under the lane's python: one VLLMEngine (child process) running a LoRA policy's adapters
beside the base weights it read at start (engines/vllm/lora.py).

After each weight sync of the adapters alone (WeightSync from a PEFT model's AdapterParams into the engine's
KeptAdapters, then load_weights), vLLM's greedy output must equal HF greedy generate on the PEFT model (the actor,
which adds the adapters' product beside the base as vLLM does) and its sampled-token log-probs HF's teacher-forced
ones; each sync loads a new adapter version. Then an adapter file changed
after the sums were taken must be refused by the arrival check. Prints one JSON line with the measurements.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from vllm_weights_check import hf_greedy, hf_token_log_probs


def main() -> None:
    import torch.distributed as dist

    from rlrun.config.model import PretrainedConfig
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.vllm.engine import VLLMEngine, VLLMOptions
    from peft import get_peft_model

    from rlrun.models.lora import LoraSettings
    from rlrun.models.tiny import EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config
    from rlrun.strategies.blocks import param_blocks
    from rlrun.weight_sync.sources import AdapterParams
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # WeightSync asks the rank
    tok = build_byte_tokenizer()
    base = build_causal_lm(tiny_model_config(), seed=3)
    settings = LoraSettings.of(PretrainedConfig(lora_rank=4, lora_alpha=8, target_modules=["all-linear"]))
    assert settings is not None
    torch.manual_seed(3)  # PEFT draws A from the global generator
    actor = get_peft_model(copy.deepcopy(base), settings.peft_config())  # the actor's module tree under LoRA
    prompts = [list(f"Write {i} digits:".encode()) for i in range(6)]
    max_new = 16
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=max_new, pad_id=PAD_ID, end_ids=(EOS_ID,))
    options = VLLMOptions(0, 0, 128, timeout_s=300, lora=settings)
    engine = VLLMEngine(copy.deepcopy(base), tok, greedy, torch.device("cpu"), options)
    source = AdapterParams(actor, param_blocks)
    sync = build_weight_sync(actor_params=source, receiver=engine.weights, route=Route(colocated=True),
                             wire=WireFormat(bucket_bytes=2 ** 20, dtype=torch.float32), device=torch.device("cpu"),
                             check_names=source.check_names())
    report: dict[str, object] = {"checks": [], "engine_on_meta": all(p.is_meta for p in engine.model.parameters())}
    gen = torch.Generator().manual_seed(7)
    for round_ in range(3):
        if round_ > 0:  # the adapters train (B starts at zero: round 0 is the base model)
            with torch.no_grad():
                for name, p in actor.named_parameters():
                    if ".lora_" in name:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        sync.sync()
        engine.load_weights()  # what the trainer does after every weight sync
        actor.eval()
        engine.sampling = greedy
        out = engine.sample(prompts, seed=11)
        engine.sampling = SamplingSettings(1.0, 1.0, max_new, PAD_ID, (EOS_ID,))
        sampled = engine.sample(prompts, seed=11)
        lp_diff = max(abs(a - b) for p, r, lps in zip(prompts, sampled.responses, sampled.log_probs)
                      for a, b in zip(lps, hf_token_log_probs(actor, p, r, 1.0)))
        report["checks"].append({  # type: ignore[union-attr]
            "round": round_, "greedy_equal": out.responses == hf_greedy(actor, prompts, max_new, EOS_ID),
            "base_greedy_equal": out.responses == hf_greedy(base, prompts, max_new, EOS_ID),
            "max_logprob_diff": lp_diff, "version": engine.adapters.current.name if engine.adapters.current else None,
            "versions_on_disk": sorted(p.name for p in Path(engine.adapters.root).iterdir()),
        })
    # An adapter file that differs from what the sync sent (here: one value changed after the sums were taken) is
    # refused by the arrival check, in one line
    version = engine.adapters.next_version()
    file = f"{version.path}/adapter_model.safetensors"
    tensors = load_file(file)
    name = next(n for n in tensors if ".lora_B." in n)
    tensors[name][0, 0] += 1.0
    save_file(tensors, file)
    try:
        engine.child.request("loading the LoRA adapters", "adapter", version)
        report["corrupt_error"] = None
    except Exception as exc:  # noqa: BLE001 - the message is the measurement
        report["corrupt_error"] = str(exc)
    engine.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
