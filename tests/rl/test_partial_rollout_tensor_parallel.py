"""--partial_rollout with a tensor-parallel engine: the engine's ranks each keep a pool of their own prompts, but
every engine call is collective over them, so they must call it together. Two real gloo processes, each a pool over
the real HF engine and the tiny long-tailed model; the vote is EngineRowExchange.any_rank on the real group.

Stand-in: the tensor-parallel vLLM engine needs the vLLM lane (tests/engines/test_vllm_e2e.py runs it); here a
wrapper makes each HF engine call collective the way TensorParallelEngine.sample is (the ranks' rows to one place),
so a rank calling the engine once more than its peer fails the run instead of passing unnoticed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlrun.data.prompts import PromptSampler
    from rlrun.engines.hf import HFEngine
    from rlrun.engines.protocol import Generation, SamplingSettings
    from rlrun.launch.transfer import EngineRowExchange
    from rlrun.models.tiny import BUILTIN_PROMPTS, EOS_ID, PAD_ID, build_byte_tokenizer
    from rlrun.rl.partial_rollout import PoolSettings, SequencePool

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cpu, tok = torch.device("cpu"), build_byte_tokenizer()
    ids = [tok.encode(r["prompt"]) for r in BUILTIN_PROMPTS]
    exchange = EngineRowExchange(dist.group.WORLD, cpu)
    model = AutoModelForCausalLM.from_pretrained(outdir / "base")
    hf = HFEngine(model, SamplingSettings(1.0, 1.0, 32, PAD_ID, (EOS_ID,)), cpu, tok)
    calls: list[int] = []
    votes: list[tuple[bool, bool]] = []

    class Collective:
        """Each call hands the ranks' row counts around first, as TensorParallelEngine.sample hands its rows."""

        def sample(self, prompts, seed, *, max_new_tokens=None, stop=()):
            calls.append(len(prompts))
            exchange.to_all(len(prompts))
            if not prompts:
                return Generation([], [])
            return hf.sample(prompts, seed, max_new_tokens=max_new_tokens, stop=stop)

    def vote(wants: bool) -> bool:
        agreed = exchange.any_rank(wants)
        votes.append((wants, agreed))
        return agreed

    sampler = PromptSampler(len(ids), 2 * 4, seed=1, num_episodes=1)
    pool = SequencePool(Collective(), ids, sampler, rank, 2, PoolSettings(2, 4, 32, 8, 2, (EOS_ID,), 7), vote)  # type: ignore[arg-type]
    batches = []
    for step in range(5):
        looks = iter(range(10))
        ahead = 1 + 2 * rank  # the learners' flag reaches the two ranks at different times
        flag = (lambda: next(looks, ahead) >= ahead) if step else None
        batches.append([{"record": r.record, "tokens": r.tokens, "versions": r.versions, "done": r.done}
                        for r in pool.take(step, max(step - 1, 0), flag)])
    (outdir / f"rank{rank}.json").write_text(json.dumps({"calls": calls, "votes": votes, "batches": batches}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_call_the_engine_together(tmp_path):
    """Both ranks call the engine the same number of times though their prompts (and so their finishing) and their
    learners' flags differ; the ranks did disagree on some rounds (the vote decided), and each still hands whole
    finished groups within the staleness bound."""
    from helpers import run_file_as_ranks, save_long_tailed_base  # not at the top: the ranks run this file

    save_long_tailed_base(tmp_path / "base", logit=5.0)
    run_file_as_ranks(__file__, 2, tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["calls"]) == len(ranks[1]["calls"]) > 5
    assert [v[1] for v in ranks[0]["votes"]] == [v[1] for v in ranks[1]["votes"]]
    assert any(wants != agreed for rank in ranks for wants, agreed in rank["votes"])
    for rank in ranks:
        for step, rows in enumerate(rank["batches"]):
            assert len(rows) == 8
            for g in range(4):
                assert rows[2 * g]["record"] == rows[2 * g + 1]["record"]
            for row in rows:
                assert row["done"] and len(row["tokens"]) == len(row["versions"]) > 0
                assert step - min(row["versions"]) <= 2


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
