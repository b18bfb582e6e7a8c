"""verl's LoRA keys (FSDP workers, PEFT): actor_rollout_ref.model.lora_rank/lora_alpha/target_modules are rlrun's
--lora_rank/--lora_alpha/--target_modules (target_modules: "all-linear" or a list); verl sets the critic's adapters
by its own critic.model keys where rlrun gives the critic the actor's, so a run with a critic must ask for the same;
what rlrun cannot do is refused in one line, loading and memory knobs are reported as ignored."""

from __future__ import annotations

import pytest

from rlrun.cli.parser import parse_args
from compat_report import verl_rows
from rlrun.runtime.errors import ConfigError

M, CM = "actor_rollout_ref.model.", "critic.model."
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "--remote_rm_url", "demo"]
GAE = ["algorithm.adv_estimator=gae", "--remote_rm_url", "demo"]


def lora_of(*argv: str):
    model = parse_args(list(argv)).config.model
    return model.lora_rank, model.lora_alpha, model.target_modules


def error_of(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_args(list(argv))
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(("value", "modules"), [
    ("all-linear", ("all-linear",)),
    ("[q_proj,v_proj]", ("q_proj", "v_proj")),
    ("['q_proj','k_proj','v_proj']", ("q_proj", "k_proj", "v_proj")),
    ('["o_proj"]', ("o_proj",)),
])
def test_actor_keys_set_the_fields(value, modules):
    assert lora_of(f"{M}lora_rank=64", f"{M}lora_alpha=32", f"{M}target_modules={value}", *GRPO) == (64, 32, modules)


def test_verl_grpo_lora_example_translates():
    """verl examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh, the LoRA part."""
    parsed = parse_args([f"{M}lora_rank=64", f"{M}lora_alpha=32", "actor_rollout_ref.rollout.load_format=safetensors",
                         "actor_rollout_ref.rollout.layered_summon=True", f"{M}use_shm=True", *GRPO])
    model = parsed.config.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (64, 32, ("all-linear",))
    text = "\n".join(parsed.ignored)
    for key in ("actor_rollout_ref.rollout.layered_summon", f"{M}use_shm", "actor_rollout_ref.rollout.load_format"):
        assert f"{key}: ignored (" in text, text


def test_later_wins_across_spellings():
    assert lora_of(f"{M}lora_rank=8", "--lora_rank", "16", *GRPO)[0] == 16
    assert lora_of("--lora_rank", "16", f"{M}lora_rank=8", *GRPO)[0] == 8


def test_critic_keys_equal_to_the_actors_are_accepted_with_a_critic():
    assert lora_of(f"{M}lora_rank=8", f"{CM}lora_rank=8", *GAE) == (8, 16, ("all-linear",))
    assert lora_of(f"{M}lora_rank=8", f"{M}lora_alpha=32", f"{M}target_modules=[q_proj,v_proj]", f"{CM}lora_rank=8",
                   f"{CM}lora_alpha=32", f"{CM}target_modules=[q_proj,v_proj]", *GAE) == (8, 32, ("q_proj", "v_proj"))


def test_a_lora_actor_with_verls_whole_critic_is_refused():
    """verl trains the critic whole unless critic.model.lora_rank is set; rlrun would give it the actor's adapters."""
    text = error_of(f"{M}lora_rank=8", *GAE)
    assert text.startswith(f"{CM}lora_rank=0 (verl default) with the actor's --lora_rank 8")
    assert "set critic.model.lora_rank" in text and "algorithm.adv_estimator=grpo" in text


@pytest.mark.parametrize(("argv", "start"), [
    ([f"{M}lora_rank=8", f"{CM}lora_rank=16"], f"{CM}lora_rank=16 with the actor's --lora_rank 8"),
    ([f"{M}lora_rank=8", f"{M}lora_alpha=32", f"{CM}lora_rank=8"], f"{CM}lora_alpha=16 (verl default) with the actor's --lora_alpha 32"),
    ([f"{M}lora_rank=8", f"{CM}lora_rank=8", f"{CM}target_modules=[q_proj]"],
     f"{CM}target_modules=q_proj with the actor's --target_modules all-linear"),
    ([f"{CM}lora_rank=8"], f"{CM}lora_rank=8 with the actor's --lora_rank 0"),
])
def test_critic_keys_that_differ_from_the_actors_are_refused(argv, start):
    assert error_of(*argv, *GAE).startswith(start)


def test_critic_keys_mean_nothing_without_a_critic():
    assert lora_of(f"{M}lora_rank=8", f"{CM}lora_rank=16", *GRPO)[0] == 8
    assert lora_of(f"{M}lora_rank=8", *GRPO)[0] == 8


def test_a_classic_lora_rank_gives_actor_and_critic_adapters_as_openrlhf():
    """No verl LoRA key: OpenRLHF's meaning (one --lora_rank for both), even beside other verl keys."""
    assert lora_of("--lora_rank", "8", *GAE)[0] == 8


def test_exclude_modules_is_refused_with_lora_on():
    text = error_of(f"{M}lora_rank=8", f"{M}exclude_modules=[lm_head]", *GRPO)
    assert text.startswith(f"{M}exclude_modules=['lm_head']: rlrun has no list of modules to leave out")
    assert "target_modules" in text
    # verl's own e2e script passes a placeholder with LoRA off: nothing asked for
    assert lora_of(f"{M}lora_rank=0", f"{M}exclude_modules=DONT_EXCLUDE", *GRPO)[0] == 0
    assert lora_of(f"{M}lora_rank=8", f"{M}exclude_modules=null", *GRPO)[0] == 8
    # a later classic --lora_rank turns LoRA on: checked on the built config
    assert error_of(f"{M}exclude_modules=[lm_head]", "--lora_rank", "8", *GRPO).startswith(f"{M}exclude_modules")


@pytest.mark.parametrize("key", [f"{M}lora_adapter_path", f"{CM}lora_adapter_path"])
def test_a_lora_adapter_path_is_rejected_with_the_fix(key):
    assert error_of(f"{key}=/ckpt/adapter", *GRPO).startswith(f"{key}: rlrun starts")
    parse_args([f"{key}=null", *GRPO])  # verl's default: nothing asked for


def test_megatron_lora_rank_is_refused_and_its_other_keys_ignored():
    text = error_of(f"{M}lora.rank=16", *GRPO)
    assert text.startswith(f"{M}lora.rank 16: verl's Megatron-backend LoRA") and "lora_rank" in text
    parsed = parse_args([f"{M}lora.rank=0", f"{M}lora.alpha=32", *GRPO])
    assert parsed.config.model.lora_rank == 0 and any(f"{M}lora.alpha: ignored (" in x for x in parsed.ignored)


def test_status_table_rows():
    rows = dict(verl_rows())
    for key in ("lora_rank", "lora_alpha", "target_modules"):
        assert rows[f"`{M}{key}`"].startswith("supported"), rows[f"`{M}{key}`"]
        assert rows[f"`{CM}{key}`"].startswith("supported"), rows[f"`{CM}{key}`"]
    assert rows[f"`{M}lora_adapter_path`"].startswith("rejected")
    assert rows[f"`{M}use_shm`"].startswith("ignored") and rows["`actor_rollout_ref.rollout.layered_summon`"].startswith("ignored")


def test_the_status_table_in_the_docs_is_the_generated_one():
    """docs/compat.md ends with what scripts/compat_report.py writes from today's flag tables (regenerate it:
    `python scripts/compat_report.py`, pasted under "Status of every flag and key")."""
    from pathlib import Path

    from compat_report import markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "compat.md").read_text()
    assert doc.endswith(markdown()), "docs/compat.md's status table is stale: regenerate it with scripts/compat_report.py"
