"""Who clips under DeepSpeed. At ZeRO-0 with bf16, DeepSpeed wraps the optimizer and steps fp32 copies of the
gradients (FP16_UnfusedOptimizer, or BF16_Optimizer with fp32 accumulation), so clipping the module's bf16 .grad
(what rlrun did) rounds the norm to bf16 and scales gradients DeepSpeed then copies on its own terms. DeepSpeed
must clip and report the norm there, as it does at ZeRO-1/2; only ZeRO-0 in fp32 is clipped by rlrun.

rlrun runs DeepSpeed in bf16 on GPUs only; this test builds the same engine config on the CPU, where DeepSpeed's CPU
accelerator supports bf16, in a one-rank gloo world of its own (a real DeepSpeed engine, a fresh process)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from rlrun.strategies.deepspeed import DSSettings, clipped_by_rlrun, ds_config

MAX_NORM = 0.5


@pytest.mark.parametrize(("stage", "bf16", "rlrun_clips"), [(0, False, True), (0, True, False), (1, True, False),
                                                             (2, False, False)])
def test_deepspeed_clips_wherever_its_optimizer_holds_the_gradients(stage, bf16, rlrun_clips) -> None:
    settings = DSSettings(stage, bf16, False, 4, MAX_NORM)
    assert clipped_by_rlrun(settings) is rlrun_clips
    assert ds_config(settings, 2, trainable=True)["gradient_clipping"] == (0.0 if rlrun_clips else MAX_NORM)
    assert ds_config(settings, 2, trainable=False)["gradient_clipping"] == 0.0


def test_zero0_bf16_step_is_clipped_by_deepspeed_with_its_fp32_norm(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from helpers import run_file_as_ranks  # not at the top: the rank runs this file as __main__

    run_file_as_ranks(__file__, 1, tmp_path, timeout=240)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["optimizer"] in ("FP16_UnfusedOptimizer", "BF16_Optimizer")
    # the norm DeepSpeed reports is the fp32 norm of the step's gradients, far above the clip
    assert got["reported_norm"] == pytest.approx(got["fp32_norm"], rel=1e-3) and got["fp32_norm"] > 100 * MAX_NORM
    # SGD with lr 1 moves the weights by the clipped gradient: its norm is --max_norm, not the raw norm
    assert got["update_norm"] == pytest.approx(MAX_NORM, rel=0.02)
    # a non-finite gradient skips the step (inf reported) and leaves the weights alone
    assert math.isinf(got["nan_norm"]) and got["nan_step_moved"] == 0.0


def _rank_main(outdir: Path) -> None:
    import os

    import torch
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import deepspeed

    from rlrun.strategies.deepspeed import DeepSpeedSteps

    class NoClipper:
        def clip_grad_norm(self, model, max_norm):  # noqa: ANN001, ANN202
            raise AssertionError("rlrun must not clip a ZeRO-0 bf16 engine's gradients")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    settings = DSSettings(0, True, False, 4, MAX_NORM)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(settings, 1, trainable=True))
    steps = DeepSpeedSteps(engine, clipped_by_rlrun(settings))

    def step(scale: float) -> tuple[float, float, float]:
        steps.zero_grad(engine.optimizer)
        before = [p.detach().float().clone() for p in engine.module.parameters()]
        loss = engine(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum() * scale
        steps.backward(loss, last_micro=True)
        grads = [p.grad.float() for p in engine.module.parameters() if p.grad is not None]
        fp32_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
        norm = steps.clip_and_step(engine.module, engine.optimizer, NoClipper(), MAX_NORM)  # type: ignore[arg-type]
        moved = torch.linalg.vector_norm(torch.cat([(p.detach().float() - b).flatten() for p, b in
                                                    zip(engine.module.parameters(), before)])).item()
        return fp32_norm, norm, moved

    fp32_norm, reported, update = step(1000.0)
    _, nan_norm, nan_moved = step(float("nan"))
    (outdir / "result.json").write_text(json.dumps({
        "optimizer": type(engine.optimizer).__name__, "fp32_norm": fp32_norm, "reported_norm": reported,
        "update_norm": update, "nan_norm": nan_norm, "nan_step_moved": nan_moved}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[4]))
    # rlrun's own exit after DeepSpeed (launch/failures.leave): no interpreter finalization, whose teardown of the
    # process groups DeepSpeed keeps alive aborted a finished rank now and then (SIGABRT, a CI run failed so)
    from rlrun.launch.failures import leave

    leave(0)
