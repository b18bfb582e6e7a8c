"""MoE policies (rlrun.models.moe, the native decoder's MoE layers, the engines' routing records) on tiny Qwen3-MoE,
Qwen2-MoE and Mixtral models built from config with transformers' own classes, in fp32: routing recorded while
sampling equals what the model's own forward routes, replaying it leaves the forward unchanged while the router
still trains, replaying other experts changes it, and the load-balancing loss is transformers' own."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlrun.data.batching import TokenBudget
from rlrun.data.packing import pack_batch
from rlrun.data.rollout import pack_rows, unpack_rows
from rlrun.engines.hf import HFEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.decoder import Decoder, expert_loop, grouped_experts
from rlrun.engines.native.engine import NativeEngine
from rlrun.models.loading import position_ids_from
from rlrun.models.moe import (
    NO_ROUTE,
    RoutingRun,
    config_routing_shape,
    in_batch_order,
    in_forward_order,
    load_balancing_loss,
    pack_routing,
    routers,
    routing_shape,
    tapped,
)
from rlrun.roles.actor import Actor, PolicyLossSettings
from rlrun.roles.forward import policy_log_probs

VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 1}
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                        num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24, num_experts=6),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=4),
}


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    config = CONFIGS[kind]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # routers far from uniform: top-k choices are not near-ties
    return model.eval()


def _sampling() -> SamplingSettings:
    return SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=6, pad_id=0, end_ids=(1,))


PROMPTS = [[5, 9, 17, 33], [7, 8], [40, 41, 42, 43, 44, 2]]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_routing_shape_from_the_config_is_the_models(kind) -> None:
    model = _model(kind)
    assert config_routing_shape(model.config) == routing_shape(model)
    if kind == "qwen3_moe":
        assert routing_shape(model).layers == 2  # mlp_only_layers [1] is dense


@pytest.mark.parametrize("engine_class", [NativeEngine, HFEngine])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_engines_record_the_routing_the_models_own_forward_takes(kind, engine_class) -> None:
    """Each sampled row's recorded routing (prompt and response tokens but the last, which is never fed back) equals
    the routing of one full forward over the row."""
    model = _model(kind)
    engine = engine_class(model, _sampling(), torch.device("cpu"))
    engine.record_routing = True
    out = engine.sample(PROMPTS, seed=3)
    assert out.routing is not None
    shape = routing_shape(model)
    for prompt, response, routing in zip(PROMPTS, out.responses, out.routing):
        tokens = prompt + response
        assert routing.shape == (len(tokens), shape.layers, shape.top_k) and routing.dtype == torch.uint8
        with torch.no_grad(), tapped(model) as routed:
            model(torch.tensor([tokens]))
        own = routed.chosen_ids()
        fed = len(tokens) - 1  # the last sampled token is never fed to the engine
        assert torch.equal(routing[:fed].sort(-1).values, own[:fed].sort(-1).values)
        assert (routing[fed:] == NO_ROUTE).all()
    if engine_class is NativeEngine:  # one row's budget: batches one after another, the same draws per row
        engine.kv_cache_bytes = engine.kv_row_bytes(max(map(len, PROMPTS)), _sampling().max_new_tokens)
        assert engine.sample(PROMPTS, seed=3).responses == out.responses and engine.last_batches == len(PROMPTS)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_native_decoder_matches_the_hf_forward(kind, grouped) -> None:
    model = _model(kind)
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    with torch.no_grad():
        want = model(ids).logits
    decoder = Decoder(model)
    decoder.grouped_experts = grouped
    assert decoder.experts_capturable() is grouped  # on CPU the default is the loop
    with decoder.weights():
        cache = decoder.new_cache(2, 8)
        first = decoder.prefill(ids[:, :4], torch.ones(2, 4, dtype=torch.bool), cache)
        step = decoder.decode(ids[:, 4], torch.tensor([4, 4]), torch.ones(2, 5, dtype=torch.bool), cache)
    torch.testing.assert_close(first, want[:, 3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, want[:, 4], rtol=1e-5, atol=1e-5)


def test_grouped_experts_are_the_loop_without_a_host_sync() -> None:
    """The grouped experts (one grouped matmul over the slots sorted by expert) give the expert loop's output, with
    experts that get no token too; traced whole by torch.compile(fullgraph=True) in bf16 (the dtype CUDA's kernel
    takes), which refuses any data-dependent step: the loop's `unique().tolist()` breaks it, so a decode step with
    grouped experts can be captured as a CUDA graph and one with the loop cannot."""
    torch.manual_seed(0)
    rows, width, inner, experts, k = 37, 32, 16, 8, 2
    flat, gate_up, down = torch.randn(rows, width), torch.randn(experts, 2 * inner, width), torch.randn(experts, width, inner)
    weights, ids = torch.softmax(torch.randn(rows, experts), -1).topk(k)
    torch.testing.assert_close(grouped_experts(flat, ids, weights, gate_up, down),
                               expert_loop(flat, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    few = torch.where(ids < 4, ids, 0)  # experts 4-7 get no token
    torch.testing.assert_close(grouped_experts(flat, few, weights, gate_up, down),
                               expert_loop(flat, few, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    bf16 = (flat.bfloat16(), ids, weights, gate_up.bfloat16(), down.bfloat16())
    traced = torch.compile(grouped_experts, fullgraph=True, backend="eager")(*bf16)
    torch.testing.assert_close(traced.float(), expert_loop(flat, ids, weights, gate_up, down), rtol=0.05, atol=1.0)
    with pytest.raises(Exception, match="[Dd]ata.dependent|GuardOnDataDependent|unique"):
        torch.compile(expert_loop, fullgraph=True, backend="eager")(*bf16)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_a_static_decode_step_with_grouped_experts_samples_what_the_default_step_does(kind) -> None:
    """The captured step's reference (step_mode "static": fixed shapes, no capture on CPU) with grouped experts
    decodes the default step's tokens, log-probs to 1e-5; recording routing (R3) decodes by the default step, whose
    expert ids it keeps."""
    model = _model(kind)
    out = {}
    for mode in ("eager", "static"):
        engine = NativeEngine(model, _sampling(), torch.device("cpu"))
        engine.decoder.grouped_experts = True
        engine.step_mode = mode
        out[mode] = engine.sample(PROMPTS, seed=4)
        if mode == "static":
            assert engine.last_steps_built >= 1
    assert out["static"].responses == out["eager"].responses
    for a, b in zip(out["static"].log_probs, out["eager"].log_probs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
    engine.record_routing = True
    engine.last_steps_built = 0
    recorded = engine.sample(PROMPTS, seed=4)
    assert recorded.routing is not None and engine.last_steps_built == 0 and recorded.responses == out["eager"].responses


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_replaying_the_own_routing_changes_nothing_and_the_router_still_trains(kind) -> None:
    model = _model(kind).train()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    with tapped(model) as routed:
        plain = model(ids).logits
    own = routed.chosen_ids()
    plain.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with tapped(model, replay=own) as again:
        replayed = model(ids).logits
    replayed.square().mean().backward()
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7)
    router = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    assert router.grad.abs().sum() > 0
    assert torch.equal(again.chosen_ids(), own)

    other = own.clone()  # every token of the first MoE layer to two other experts
    experts = routing_shape(model).experts
    other[:, 0] = (own[:, 0].long() + 1).remainder(experts).to(torch.uint8)
    other[:, 0, 1] = (other[:, 0, 0].long() + 1).remainder(experts).to(torch.uint8)
    with torch.no_grad(), tapped(model, replay=other) as moved:
        changed = model(ids).logits
    assert not torch.allclose(changed, plain)
    assert torch.equal(moved.chosen_ids()[:, 0], other[:, 0])
    # NO_ROUTE positions route by themselves
    partial = other.clone()
    partial[:] = NO_ROUTE
    with torch.no_grad(), tapped(model, replay=partial):
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_load_balancing_loss_is_transformers_own_over_the_real_tokens(kind) -> None:
    model = _model(kind)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad(), tapped(model) as routed:
        out = model(ids, attention_mask=mask, output_router_logits=True)
    shape = routing_shape(model)
    want = load_balancing_loss_func(out.router_logits, shape.experts, shape.top_k, mask)
    got = load_balancing_loss(routed, shape.top_k, mask.bool().reshape(-1))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)


def test_packed_and_padded_forwards_replay_the_same_routing() -> None:
    """The rollout's routing ([b, L] aligned with its tokens) follows the tokens into packed rows: the replayed
    packed log-probs equal the replayed padded ones, and both differ from the unreplayed ones when the routing is
    another model's."""
    model, sampler = _model("qwen3_moe"), _model("qwen3_moe", seed=1)
    engine = NativeEngine(sampler, _sampling(), torch.device("cpu"))
    engine.record_routing = True
    out = engine.sample(PROMPTS, seed=5)
    P, R = 8, 6
    batch = unpack_rows(pack_rows(PROMPTS, out.responses, P, R, 0), P)
    full = pack_routing(out.routing, [len(p) for p in PROMPTS], P, R, routing_shape(model))
    p = batch.sequences.shape[1] - batch.response_width
    batch.routing = full[:, P - p : P + batch.response_width]
    packed = pack_batch(batch, batch.sequences.shape[1])  # rows as wide as the padded ones: some tail padding
    order = in_forward_order(batch.routing, packed.source)
    assert (packed.source < 0).any() and (order[packed.source.reshape(-1) < 0] == NO_ROUTE).all()
    with torch.no_grad():
        padded = policy_log_probs(model, batch, 1.0, moe=RoutingRun(replay=True))[0]
        run = RoutingRun(replay=True)
        packed_lp = policy_log_probs(model, batch, 1.0, packing=True, moe=run)[0]
        own = policy_log_probs(model, batch, 1.0)[0]
    mask = batch.action_mask.bool()
    torch.testing.assert_close(packed_lp[mask], padded[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(own[mask], padded[mask])
    _, numbers = run.metrics(routing_shape(model).top_k)
    assert 0 < numbers["moe/router_mismatch_frac"] <= 1  # the sampler's routers are another model's


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("micro", [2, TokenBudget(16)], ids=["rows", "token_budget"])
def test_r2_records_the_scoring_routing_at_each_token_and_the_training_pass_replays_it(packing, micro) -> None:
    """--router_replay R2: the actor's scoring pass (micro-batched, trimmed to each micro-batch's lengths by a
    token budget, padded or packed) records each real token's experts at that token's column of the batch, NO_ROUTE
    on padding; a later forward replaying them routes every recorded token through those experts even after the
    router changed (which it would otherwise route elsewhere), and equals the scoring pass while nothing changed."""
    model = _model("qwen3_moe")
    engine = NativeEngine(_model("qwen3_moe", seed=1), _sampling(), torch.device("cpu"))
    prompts = PROMPTS * 2
    out = engine.sample(prompts, seed=7)
    batch = unpack_rows(pack_rows(prompts, out.responses, 8, 6, 0), 8)
    settings = PolicyLossSettings(0.2, None, "token-mean", 1.0, None, False, "k1", router_replay="R2")
    actor = Actor(model, None, settings, torch.device("cpu"), packing=packing)  # type: ignore[arg-type]  # scoring only
    scored = actor.log_probs(batch, micro)
    recorded = actor.recorded_routing
    shape = routing_shape(model)
    assert recorded is not None and recorded.shape == (*batch.sequences.shape, shape.layers, shape.top_k)
    real = batch.attention_mask.bool()
    assert (recorded[~real] == NO_ROUTE).all() and (recorded[real] != NO_ROUTE).all()
    with torch.no_grad(), tapped(model) as whole:  # the truth: one padded forward over every row
        mask = batch.attention_mask
        model(batch.sequences, attention_mask=mask, position_ids=position_ids_from(mask))
    truth = whole.chosen_ids().view(recorded.shape)
    assert torch.equal(recorded[real].sort(-1).values, truth[real].sort(-1).values)

    batch.routing = recorded
    mask = batch.action_mask.bool()
    with torch.no_grad():
        run = RoutingRun(replay=True)
        again = policy_log_probs(model, batch, 1.0, packing=packing, moe=run)[0]
        torch.testing.assert_close(again[mask], scored[mask], rtol=1e-5, atol=1e-5)
        for router in routers(model):  # an update moved the routers
            router.weight.add_(torch.randn_like(router.weight))
        run = RoutingRun(replay=True)
        policy_log_probs(model, batch, 1.0, packing=packing, moe=run)
    assert run.routed is not None
    replayed = in_batch_order(run.routed.chosen_ids(), tuple(batch.sequences.shape), run.source)
    assert torch.equal(replayed[real].sort(-1).values, recorded[real].sort(-1).values)
    _, numbers = run.metrics(shape.top_k)
    assert numbers["moe/router_mismatch_frac"] > 0.05  # without replay these tokens would go elsewhere


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_replay_shrinks_the_gap_to_a_bf16_engine(kind) -> None:
    """The engine samples in bf16 (as vLLM does), the trainer scores in fp32: near-tied routers pick other experts
    for some tokens. Replaying the engine's routing lowers the engine-vs-trainer log-prob gap on the rows whose
    routing it moved, and changes nothing on the others (measured over seeds 0-3, moved rows: qwen3_moe mean
    5.8-8.2e-4 -> 5.0-6.3e-4, max up to 8.4e-3 -> 2.1e-3; mixtral 5.4-7.8e-4 -> 4.1-5.6e-4, max up to 8.9e-3 ->
    1.8e-3; 0.3-0.6 % of (token, layer) routings differ, in 11-18 of 128 rows)."""
    import copy

    from rlrun.data.rollout import pack_log_probs

    model = _model(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():  # routers near ties, experts that differ
            p.mul_((0.05 if name.endswith("mlp.gate.weight") else 0.15) / 0.3)
    engine = NativeEngine(copy.deepcopy(model).to(torch.bfloat16), _sampling(), torch.device("cpu"))
    engine.record_routing = True
    prompts = [[(7 * i + j) % 60 + 2 for j in range(6 + i % 5)] for i in range(128)]
    out = engine.sample(prompts, seed=1)
    P, R = 12, 6
    batch = unpack_rows(pack_rows(prompts, out.responses, P, R, 0), P)
    full = pack_routing(out.routing, [len(p) for p in prompts], P, R, routing_shape(model))
    batch.routing = full[:, P - (batch.sequences.shape[1] - batch.response_width) : P + batch.response_width]
    engine_lp = pack_log_probs(out.log_probs, R)[:, : batch.response_width]
    mask = batch.action_mask.bool()
    run, own_run = RoutingRun(replay=True), RoutingRun(replay=False)
    with torch.no_grad():
        replayed = (policy_log_probs(model, batch, 1.0, moe=run)[0] - engine_lp).abs()
        own = (policy_log_probs(model, batch, 1.0, moe=own_run)[0] - engine_lp).abs()
    assert 0 < run.metrics(routing_shape(model).top_k)[1]["moe/router_mismatch_frac"] < 0.05
    mine = own_run.recorded(tuple(batch.sequences.shape)).sort(-1).values
    given = batch.routing.sort(-1).values
    moved = ((mine != given) & (given != NO_ROUTE)).flatten(1).any(1)[:, None] & mask  # rows replay changed
    kept = mask & ~moved
    assert moved.any() and kept.any()
    assert replayed[moved].mean() < own[moved].mean() and replayed[moved].max() <= own[moved].max()
    assert torch.equal(replayed[kept], own[kept])  # the same experts: the same numbers


def test_the_aux_loss_spreads_a_skewed_router() -> None:
    """From routers that send most tokens to experts 0 and 1, minimising the load-balancing loss alone lowers the most
    loaded expert's share (what --aux_loss_coef adds to the actor's loss)."""
    model = _model("qwen3_moe").train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p[0] *= 4.0
                p[1] = -p[0]  # one of experts 0 and 1 wins every token's first choice
    ids = torch.randint(2, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
    routers_only = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    optimizer = torch.optim.Adam(routers_only, lr=0.05)
    loads = []
    for _ in range(30):
        run = RoutingRun(replay=False)
        with run.around(model, None, torch.ones(ids.numel(), dtype=torch.bool)):
            model(ids)
        aux, numbers = run.metrics(2)
        loads.append(numbers["moe/max_expert_load"])
        layers = [numbers[f"moe/max_expert_load/sparse_layer_{i}"] for i in range(routing_shape(model).layers)]
        assert numbers["moe/max_expert_load"] == pytest.approx(sum(layers) / len(layers))
        optimizer.zero_grad()
        aux.backward()
        optimizer.step()
    assert loads[0] > 0.2 and loads[-1] < loads[0] - 0.05, loads  # uniform: 2 / 8 experts per token, 0.125


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_lora_on_a_moe_policy_adapts_attention_and_refuses_the_routed_experts(kind, tmp_path) -> None:
    """--lora_rank with all-linear on a MoE policy puts adapters on the nn.Linear layers but the head and those
    PEFT reads as the fused routed experts (Qwen3-MoE's gate/up/down_proj, here a dense layer's): attention everywhere,
    Qwen2-MoE's shared expert; routers and experts stay frozen and unwrapped.
    Naming per-expert projections explicitly is one ConfigError saying why."""
    from rlrun.config.model import PretrainedConfig
    from rlrun.models.loading import policy_weights, unfilled_trained_policy
    from rlrun.runtime.errors import ConfigError

    _model(kind).save_pretrained(tmp_path)
    source = PretrainedConfig(pretrain=str(tmp_path), lora_rank=4)
    policy = unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(torch.device("cpu"))
    adapted = {n.split(".lora_A.")[0].split(".layers.0.")[1] for n, _ in policy.named_parameters()
               if ".lora_A." in n and ".layers.0." in n}
    shared = {f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")} | {"mlp.shared_expert_gate"}
    want = {f"self_attn.{p}_proj" for p in "qkvo"} | (shared if kind == "qwen2_moe" else set())
    assert adapted == want
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    if kind == "qwen3_moe":  # the one of the three whose per-expert names PEFT maps onto the fused experts
        explicit = PretrainedConfig(pretrain=str(tmp_path), lora_rank=4, target_modules=("q_proj", "gate_proj", "up_proj"))
        with pytest.raises(ConfigError, match="puts LoRA on MoE routers or routed experts"):
            unfilled_trained_policy(explicit, 0, policy_weights(explicit, 0))


@pytest.mark.parametrize(("argv", "kind", "backend", "message"), [
    (["--router_replay", "R3"], None, "native", "--router_replay R3: the policy (qwen2) has no MoE layers"),
    (["--aux_loss_coef", "0.01"], None, "native", "--aux_loss_coef 0.01: the policy (qwen2) has no MoE layers"),
    (["--aux_loss_coef", "-1"], "qwen3_moe", "native", "--aux_loss_coef must be >= 0, got -1"),
    (["--router_replay", "R3"], "qwen3_moe", "vllm", "rlrun's vLLM adapter does not read them yet"),
    (["--router_replay", "R3", "--partial_rollout", "--async_train"], "mixtral", "native", "with --partial_rollout"),
    (["--aux_loss_coef", "0.01", "--sequence_parallel_size", "2"], "qwen2_moe", "hf", "--sequence_parallel_size 2"),
    (["--router_replay", "R2"], None, "vllm", "--router_replay R2: the policy (qwen2) has no MoE layers"),
    (["--router_replay", "R2", "--sequence_parallel_size", "2"], "mixtral", "vllm",
     "R2 with --sequence_parallel_size 2"),
])
def test_moe_options_the_policy_or_backend_cannot_run_are_one_error(argv, kind, backend, message) -> None:
    from rlrun.cli.parser import parse_args
    from rlrun.models.tiny import tiny_model_config
    from rlrun.plan.generation import check_moe_options
    from rlrun.runtime.errors import ConfigError

    cfg = parse_args(argv).config
    config = tiny_model_config() if kind is None else CONFIGS[kind]()
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_moe_options(cfg, config, backend)
    check_moe_options(parse_args([]).config, config, backend)  # the defaults pass on any policy


def test_verl_and_openrlhf_spellings_set_replay_and_the_aux_loss() -> None:
    from rlrun.cli.parser import parse_args
    from rlrun.plan.generation import check_moe_options
    from rlrun.runtime.errors import ConfigError

    cfg = parse_args(["actor_rollout_ref.actor.router_replay.mode=R3", "--actor.aux_loss_coef", "0.002"]).config
    assert (cfg.algo.router_replay, cfg.algo.aux_loss_coef) == ("R3", 0.002)
    assert parse_args(["actor_rollout_ref.actor.router_replay.mode=disabled"]).config.algo.router_replay == "off"
    assert parse_args(["--aux_loss_coef", "0.01"]).config.algo.aux_loss_coef == 0.01
    r2 = parse_args(["actor_rollout_ref.actor.router_replay.mode=R2"]).config
    assert r2.algo.router_replay == "R2"
    check_moe_options(r2, CONFIGS["mixtral"](), "vllm")  # R2 replays the trainer's own pass: any engine
    with pytest.raises(ConfigError, match="router_replay.mode=R1: verl's modes are disabled, R2 and R3"):
        parse_args(["actor_rollout_ref.actor.router_replay.mode=R1"])
