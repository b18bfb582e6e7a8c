#!/usr/bin/env bash
# The whole pipeline offline, on the embedded tiny model and generated data (rlrun.supervised.datasets: answer
# "Write some digits:" with digits, "... letters:" with lowercase letters):
#
#   SFT (rlrun.sft) -> reward model from the SFT model (rlrun.rm) -> PPO from the SFT model with that reward
#   model (rlrun.ppo --reward_pretrain), DPO from the SFT model (rlrun.dpo), and on-policy distillation of the SFT
#   model into a fresh one (rlrun.ppo --teacher_pretrain, configs/distill_demo.yaml).
#
#   bash examples/pipeline/run.sh [OUT_DIR] [RANKS]      # from the repository root; defaults runs/pipeline, 2
#
# Every stage is a torchrun job with OpenRLHF's flag names; each writes OUT_DIR/<stage>/metrics.jsonl and its
# model in Hugging Face format. About 2 minutes on 2 CPU cores.
set -euo pipefail
OUT=${1:-runs/pipeline}
RANKS=${2:-2}
PY=${RLRUN_PYTHON:-python}
run() { "$PY" -m torch.distributed.run --standalone --nproc_per_node "$RANKS" -m "$@"; }
BATCH=(--train_batch_size 16 --micro_train_batch_size 8 --max_len 64)

"$PY" -m rlrun.supervised.datasets "$OUT/data"
run rlrun.sft --dataset "$OUT/data/sft.jsonl" --output_key output --input_template '{}' "${BATCH[@]}" \
    --max_epochs 2 --learning_rate 3e-3 --save_path "$OUT/sft"
run rlrun.rm --pretrain "$OUT/sft" --dataset "$OUT/data/pairs.jsonl" --eval_dataset "$OUT/data/pairs_eval.jsonl" \
    --eval_before_train --eval_steps 8 "${BATCH[@]}" --learning_rate 1e-3 --save_path "$OUT/rm"
run rlrun.ppo --config configs/demo.yaml --pretrain "$OUT/sft" --reward_pretrain "$OUT/rm" --max_steps 20 \
    --actor_learning_rate 2e-3 --save_path "$OUT/ppo"
run rlrun.dpo --pretrain "$OUT/sft" --dataset "$OUT/data/pairs.jsonl" --eval_dataset "$OUT/data/pairs_eval.jsonl" \
    --eval_before_train --eval_steps 8 "${BATCH[@]}" --learning_rate 5e-4 --beta 0.1 --save_path "$OUT/dpo"
run rlrun.ppo --config configs/distill_demo.yaml --teacher_pretrain "$OUT/sft" --save_path "$OUT/distill"
echo "pipeline done: $OUT/{sft,rm,ppo,dpo,distill}"
