"""Search-R1 through the whole trainer: torchrun (2 ranks, engine disaggregated), the built-in agent, a
live `python -m rlrun.retriever_server` process, configs/search_r1.yaml.

A random tiny model never writes `<search>`, so the policy is first taught (teacher forcing, a few
seconds on CPU) the Search-R1 trajectory of two questions: search for the question, read the information
the live retriever returns, answer. The trained trajectory is real model output from then on: the
trainer samples it, the agent parses it, the retriever serves it, the exact match scores it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, run_rlrun, teach_tiny_model
from retriever_process import EXAMPLE_TRAIN, start_retriever, stop_retriever
from rlrun.agents.search_r1 import RetrieverClient
from rlrun.agents.search_r1 import information_block


def _taught_model(out: Path, records: list[dict], retriever_url: str) -> None:
    """The tiny model, with room for Search-R1's long prompt, trained to reproduce each record's trajectory."""
    hits = RetrieverClient(retriever_url, 3, timeout_s=10, retries=2).search_batch([r["question"] for r in records])
    teach_tiny_model(out, [[(r["prompt"], False), (f"<search> {r['question']} </search>", True),
                            (information_block(found)[:128], False), (f"<answer> {r['golden_answers'][0]} </answer>", True)]
                           for r, found in zip(records, hits)], max_positions=2048)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_search_r1_trains_against_a_live_retriever(tmp_path: Path) -> None:
    server = start_retriever(tmp_path)
    try:
        records = [json.loads(line) for line in EXAMPLE_TRAIN.read_text().splitlines()[:2]]
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        _taught_model(tmp_path / "policy", records, server.url)
        before = server.wait_log_lines("POST /retrieve -> 200", 1)
        res = run_rlrun(2, ["--config", str(REPO / "configs/search_r1.yaml"), "--pretrain", str(tmp_path / "policy"),
                            "--prompt_data", str(data), "--retriever_url", server.url, "--max_steps", "2",
                            "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
                            "--micro_rollout_batch_size", "2", "--micro_train_batch_size", "2",
                            "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1", "--temperature", "0.3",
                            "--num_episodes", "2"],
                        tmp_path / "out")
        assert res.returncode == 0, res.output[-3000:]
        assert [m["step"] for m in res.metrics] == [1, 2]
        for m in res.metrics:
            assert m["agent/searches"] >= 0.5, m  # the taught policy searches (logged per episode)
            assert m["agent/exact_match"] >= 0.5 and m["reward"] == m["agent/exact_match"], m
            assert m["agent/observation_tokens"] > 20 and m["agent/turns"] >= 2, m
        # The engine rank's searches reached the live server, one POST per turn (coalesced).
        assert server.wait_log_lines("POST /retrieve -> 200", before + 2) >= before + 2, server.log()
    finally:
        stop_retriever(server.proc)
