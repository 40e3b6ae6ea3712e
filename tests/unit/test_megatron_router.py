"""The router against megatron-core's own TopKRouter (built on the CPU in a one-rank gloo world, holding moezero's
gate): the router losses' weights under --calculate-per-token-loss (what its MoEAuxLossAutoScaler attaches), the
input jitter in evaluation, and which assignments a capacity factor keeps (torch.topk's picks over its
sequence-major tokens)."""

import dataclasses

import pytest
import torch

from moezero.config import MoEConfig
from moezero.keyed_random import SampleKeys
from moezero.moe.router import TopKRouter
from tests.dist_utils import run_distributed
from tests.megatron_oracle import CPU_BUILD, megatron_on_cpu

pytest.importorskip("megatron.core")
B, S, D, E, K = 2, 16, 16, 4, 2


def _ours(**kwargs) -> TopKRouter:
    router = TopKRouter(MoEConfig(**{"hidden_size": D, "num_experts": E, "top_k": K, "router_dtype": "fp64", **kwargs}))
    with torch.no_grad():
        router.wg.weight.copy_(torch.randn(E, D, generator=torch.Generator().manual_seed(3)))
    return router


def _theirs(ours: TopKRouter, per_token: bool = False):
    """megatron-core's TopKRouter with `ours`'s settings and gate (call inside megatron_on_cpu)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter as MegatronRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = ours.config
    config = TransformerConfig(
        num_layers=1,
        hidden_size=D,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=cfg.top_k,
        moe_router_pre_softmax=cfg.pre_softmax,
        moe_router_load_balancing_type=cfg.load_balancing_type,
        moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_z_loss_coeff=cfg.z_loss_coeff,
        moe_expert_capacity_factor=cfg.capacity_factor,
        moe_token_drop_policy=cfg.token_drop_policy,
        moe_input_jitter_eps=cfg.input_jitter_eps,
        calculate_per_token_loss=per_token,
        add_bias_linear=False,
        moe_router_dtype="fp64",
        **CPU_BUILD,
    )
    theirs = MegatronRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    theirs.set_layer_number(1)
    with torch.no_grad():
        theirs.weight.copy_(ours.wg.weight)
    return theirs


def _tokens(generator_seed: int = 1) -> torch.Tensor:
    """B sequences of S tokens, batch-major as moezero lays them out."""
    return torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(generator_seed))


def _sequence_major(x_BS: torch.Tensor) -> torch.Tensor:
    return x_BS.transpose(0, 1).contiguous()


def _per_token_gradients(load_balancing_type: str):
    """The gate's gradient from the router losses alone, ours (the token-weighted losses) and megatron-core's (its
    autoscaler's, at loss scale 1: the per-token schedule's; both before the division by the global tokens)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    ours = _ours(load_balancing_type=load_balancing_type, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = _tokens()
    routing = ours(x.reshape(B * S, D), num_sequences=B)
    sum(routing.token_weighted.values()).backward()
    with megatron_on_cpu():
        theirs = _theirs(ours, per_token=True)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        probs, _ = theirs(_sequence_major(x))
        (probs * 0).sum().backward()  # only the attached losses reach the gate
    return ours.wg.weight.grad, theirs.weight.grad


@pytest.mark.parametrize("load_balancing_type", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_per_token_loss_weighs_the_router_losses_as_megatron_core(load_balancing_type):
    """Megatron's per-token schedule attaches each aux loss times its routing map's rows (the micro-batch's tokens;
    the sequence length for the sequence aux loss, whose map is [S, B * E]) and the z-loss times the tokens, at
    scale 1, then divides every gradient by the global batch's loss tokens (the training loop's part, in
    test_megatron_loss_and_norms); moezero averaged them per micro-batch instead."""
    ours, theirs = run_distributed(_per_token_gradients, 1, load_balancing_type, timeout=300)[0]
    assert theirs.abs().max() > 1e-3
    # megatron-core computes the losses' scores in fp32: 1e-6 of the largest; a wrong weight is off by 2x or more
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 * float(theirs.abs().max()))


@torch.no_grad()
def _jittered_evaluation():
    ours = _ours(input_jitter_eps=0.2).eval()
    unjittered = TopKRouter(dataclasses.replace(ours.config, input_jitter_eps=None)).eval()
    unjittered.load_state_dict(ours.state_dict())
    x = _tokens()
    keys = SampleKeys(5, 2, (10, 11))
    routing = ours(x.reshape(B * S, D), num_sequences=B, keys=keys)
    still = unjittered(x.reshape(B * S, D), num_sequences=B, keys=keys)
    noise_BSD = keys.uniform(ours.site + ".jitter", (S, D), 0.8, 1.2).double()
    with megatron_on_cpu():
        theirs, their_plain = _theirs(ours).eval(), _theirs(unjittered).eval()
        moved = (theirs(_sequence_major(x))[0] - their_plain(_sequence_major(x))[0]).abs().max()
        theirs.input_jitter = lambda shape: _sequence_major(noise_BSD)  # moezero's noise, to compare the routing
        probs, routing_map = theirs(_sequence_major(x))
    return routing, still, probs, routing_map, moved


def test_the_input_jitter_applies_in_evaluation_as_megatron_cores():
    """megatron-core's router multiplies its input by uniform noise in every forward, evaluation included; moezero's
    did only in training. With moezero's keyed noise in its place, Megatron's evaluation routes as moezero's."""
    routing, still, probs, routing_map, moved = run_distributed(_jittered_evaluation, 1, timeout=300)[0]
    assert moved > 1e-3  # Megatron's evaluation jitters
    assert (routing.topk_weights_TK - still.topk_weights_TK).abs().max() > 1e-3  # and so does moezero's
    their_map = routing_map.view(S, B, E).transpose(0, 1).reshape(B * S, E)
    their_probs = probs.view(S, B, E).transpose(0, 1).reshape(B * S, E)
    ours_map = torch.zeros(B * S, E, dtype=torch.bool).scatter_(1, routing.topk_ids_TK, True)
    assert torch.equal(ours_map, their_map)
    torch.testing.assert_close(
        their_probs.gather(1, routing.topk_ids_TK), routing.topk_weights_TK, rtol=1e-5, atol=0
    )  # its top-k softmax is fp32


@torch.no_grad()
def test_a_bare_eval_call_draws_no_jitter_and_training_does():
    """Outside the training loop (no keys: generation, the export and evaluation tools) an eval-mode router draws
    no jitter, so two calls agree (a quantized export matched its fake-quant model only by chance before); in
    training, without keys, it still draws from torch's generator."""
    ours = _ours(input_jitter_eps=0.2).eval()
    x = _tokens().reshape(B * S, D)
    first, second = ours(x, num_sequences=B), ours(x, num_sequences=B)
    assert torch.equal(first.topk_weights_TK, second.topk_weights_TK)
    ours.train()
    assert (ours(x, num_sequences=B).topk_weights_TK - first.topk_weights_TK).abs().max() > 1e-3


@torch.no_grad()
def _capacity_picks(policy: str, capacity_factor: float, top_k: int):
    ours = _ours(
        capacity_factor=capacity_factor,
        token_drop_policy=policy,
        load_balancing_type="none",
        top_k=top_k,
        pre_softmax=top_k == 1,
    )
    x = _tokens(4)
    routing = ours(x.reshape(B * S, D), num_sequences=B)
    with megatron_on_cpu():
        _, routing_map = _theirs(ours)(_sequence_major(x))
    dropless = dataclasses.replace(ours.config, capacity_factor=None)
    wanted = TopKRouter(dropless)
    wanted.load_state_dict(ours.state_dict())
    return routing, wanted(x.reshape(B * S, D)).topk_ids_TK, routing_map.view(S, B, E).transpose(0, 1).reshape(-1, E)


@pytest.mark.parametrize(
    "policy, capacity_factor, top_k", [("position", 1.0, 2), ("position", 0.5, 1), ("probs", 0.75, 2)]
)
def test_capacity_keeps_what_megatron_cores_router_keeps(policy, capacity_factor, top_k):
    """megatron-core keeps, per expert, what torch.topk picks along its tokens in sequence-major order (for
    "position", among the routing map's equal ones: on the CPU mostly the later positions of every sequence);
    moezero kept each expert's first assignments in batch-major order (all of sequence 0 first)."""
    routing, wanted_TK, their_map = run_distributed(_capacity_picks, 1, policy, capacity_factor, top_k, timeout=300)[0]
    kept = routing.topk_ids_TK >= 0
    ours_map = torch.zeros(B * S, E, dtype=torch.bool).scatter_(1, wanted_TK, kept)
    assert torch.equal(ours_map, their_map)
    assert 0 < routing.dropped_fraction < 1
    if policy == "position":  # the batch-major first-come rule keeps other assignments
        capacity = (their_map.sum(0)).max()
        wanted_TE = torch.zeros(B * S, E, dtype=torch.long).scatter_(1, wanted_TK, 1)
        first_come = (wanted_TE.cumsum(0) <= capacity) & wanted_TE.bool()
        assert not torch.equal(first_come, their_map)


def test_evaluation_jitter_is_keyed_by_sample_so_any_layout_draws_the_same():
    """evaluate() keys the evaluation's jitter by (seed, split, iteration, sample) as training's: one micro-batch of
    two samples or two of one give the same loss; another iteration draws other noise."""
    from moezero.config import GPTConfig
    from moezero.models import GPTModel
    from moezero.training.loop import evaluate

    config = GPTConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=8,
        vocab_size=50,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, MoEConfig(num_experts=4, top_k=2, input_jitter_eps=0.5), seed=1).double()
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, 50, (2, 8), generator=g),
        "labels": torch.randint(0, 50, (2, 8), generator=g),
        "loss_mask": torch.ones(2, 8, dtype=torch.float64),
        "sample_index": torch.tensor([4, 5]),
    }
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    whole = evaluate(model, [batch], None, seed=7, iteration=3)
    assert evaluate(model, halves, None, seed=7, iteration=3) == pytest.approx(whole, rel=1e-12)
    assert evaluate(model, [batch], None, seed=7, iteration=4) != pytest.approx(whole, rel=1e-9)
