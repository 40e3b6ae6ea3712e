"""The central test: N ranks of ZeRO reproduce single-process PyTorch on the same global batch.

float64 on the reference path, so agreement is ~1e-12. Compared every step: the reduced gradient
of every element this rank owns, the global grad norm (clipping engaged), and all parameters.
AdamW alone would hide a constant gradient-scale bug, so SGD with momentum runs too.

The matrix is the full product of ep x stage x accumulation x optimizer x no_sync (accumulating
with plain `loss.backward()` calls is as valid as marking earlier micro-steps with `no_sync`),
and every configuration also cycles through overlap on/off and tiny (many buckets, dozens in
flight), medium and huge (one bucket) bucket sizes. The model has a branch only rank 0 uses, a
branch used by data, one skipped on odd steps, experts without tokens, tied weights and a
checkpointed block.

The same reproduction with torch's own collectives serving every group (`parallel/transport.py`'s `Transport`)
in place of the pipes, shared-memory rings and point-to-point exchanges: the transport seam is swappable and
the callers are served through it.
"""

import collections
import itertools

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, Transport
from moezero.parallel.transport import transport_of
from moezero.zero import ShardedGradient, ZeroOptimizer
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import ZeroTestModel
from tests.zero_reference import OPTIMIZERS, ZERO_STAGES, assert_params_match, reference_run, train_step

STEPS, CLIP, TOL = 5, 0.05, 1e-10
VARIANTS = [(True, 16), (False, 150), (True, 10**9), (False, 16), (True, 150), (False, 10**9)]


def _check_config(ep, stage, accumulation, optimizer, use_no_sync, overlap, bucket_size, references, transports=None):
    groups = ParallelGroups.build(expert_parallel_size=ep, transports=transports)
    model = ZeroTestModel(groups).double()
    frozen_before = model.frozen.weight.detach().clone()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = ZeroOptimizer(
        model,
        cls,
        groups,
        stage=stage,
        bucket_size=bucket_size,
        overlap_comm=overlap,
        clip_grad=CLIP,
        grad_reduce_dtype=torch.float64,
        **kwargs,
    )
    reference = references[(optimizer, accumulation)]
    opt.count_zeros_in_grad = True
    for step in range(STEPS):
        train_step(model, opt, step, accumulation, use_no_sync)
        if stage >= 1:
            assert all(p.grad is None or isinstance(p.grad, ShardedGradient) for p in model.parameters()), (
                "stages 1-3 hold no full gradients after a sync"
            )
        opt.reduce_gradients()
        _compare_owned_grads(opt, reference[step]["grads"])
        opt.step()
        opt.zero_grad()
        ref_norm = reference[step]["norm"]
        assert abs(opt.last_grad_norm - ref_norm) <= TOL * ref_norm, (opt.last_grad_norm, ref_norm)
        zeros = _zeros(model, reference[step]["grads"], reference[step]["params"])
        assert opt.last_num_zeros_in_grad == zeros, ("num zeros", opt.last_num_zeros_in_grad, zeros)
        ref_params_norm = _norm(model, reference[step]["params"])
        params_norm = opt.params_norm()
        assert abs(params_norm - ref_params_norm) <= TOL * ref_params_norm, (
            "params norm",
            params_norm,
            ref_params_norm,
        )
        assert ref_norm > CLIP  # clipping engaged
        with opt.full_parameters():
            assert_params_match(model, reference[step]["params"], rtol=TOL, atol=1e-13)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert opt.counters.fires.get(name, 0) + opt.counters.zero_fills.get(name, 0) == STEPS * accumulation
    assert opt.counters.zero_fills.get("odd_step_branch.weight", 0) >= (STEPS // 2) * accumulation
    with opt.full_parameters():
        assert torch.equal(model.frozen.weight, frozen_before)
        assert_replicas_equal(model, groups)
    if transports is not None:
        every = (groups.dp, groups.ep, groups.edp, groups.control, groups.agreement_group(), *groups.gather_groups())
        assert all(type(transport_of(g)) is transports for g in every if g is not None)
    groups.destroy()


def _trainable(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _zeros(model, ref_grads, ref_params):
    """Megatron's num-zeros: exact zeros over every trainable element (no gradient at all: all of them)."""
    return sum(
        ref_params[n].numel() if ref_grads[n] is None else int((ref_grads[n] == 0).sum()) for n in _trainable(model)
    )


def _norm(model, ref_params):
    return sum(float((ref_params[n].double() ** 2).sum()) for n in _trainable(model)) ** 0.5


def _compare_owned_grads(opt, ref_grads):
    """The averaged gradient of every element this rank owns (global coordinates) against torch's."""
    for name, pieces in opt.owned_gradients().items():
        ref = ref_grads[name]
        for (lo, hi), grad in pieces:
            expected = torch.zeros_like(grad) if ref is None else ref.reshape(-1)[lo:hi]
            torch.testing.assert_close(grad, expected, rtol=TOL, atol=1e-13, msg=lambda m: f"{name} grad: {m}")


def _matrix(eps):
    world = dist.get_world_size()
    references = {(o, a): reference_run(o, world, a, STEPS, clip=CLIP) for o in OPTIMIZERS for a in (1, 4)}
    done = []
    combos = itertools.product(eps, ZERO_STAGES, (1, 4), OPTIMIZERS, (True, False))
    for i, (ep, stage, accumulation, optimizer, use_no_sync) in enumerate(combos):
        if accumulation == 1 and not use_no_sync:
            continue  # one micro-batch: no_sync has nothing to mark
        overlap, bucket_size = VARIANTS[i % len(VARIANTS)]
        try:
            _check_config(ep, stage, accumulation, optimizer, use_no_sync, overlap, bucket_size, references)
        except AssertionError as exc:
            raise AssertionError(
                f"ep={ep} stage={stage} accumulation={accumulation} {optimizer} "
                f"no_sync={use_no_sync} overlap={overlap} bucket={bucket_size}: {exc}"
            ) from None
        done.append((ep, stage, accumulation, optimizer))
    return len(done)


class _CountingTransport(Transport):
    """torch's own collectives, counting the collectives of each kind that reached them through the seam."""

    launched = collections.Counter()

    def all_to_all(self, *args):
        self.launched["all_to_all"] += 1
        return super().all_to_all(*args)

    def exchange_counts(self, *args):
        self.launched["exchange_counts"] += 1
        return super().exchange_counts(*args)

    def gather_copies(self, *args):
        self.launched["gather_copies"] += 1
        return super().gather_copies(*args)

    def all_reduce(self, *args):
        self.launched["all_reduce"] += 1
        return super().all_reduce(*args)

    def reduce_scatter(self, *args):
        self.launched["reduce_scatter"] += 1
        return super().reduce_scatter(*args)

    def all_gather(self, *args):
        self.launched["all_gather"] += 1
        return super().all_gather(*args)


def _torch_collectives():
    """ep 2 at stage 2 (the token all-to-alls and count exchanges on the ep group, the dense buckets on dp) and
    ep 1 at stage 3 (the parameter gathers on their own groups, the expert buckets on edp)."""
    world = dist.get_world_size()
    references = {("adamw", 4): reference_run("adamw", world, 4, STEPS, clip=CLIP)}
    for ep, stage in ((2, 2), (1, 3)):
        _CountingTransport.launched.clear()
        _check_config(ep, stage, 4, "adamw", True, True, 16, references, transports=_CountingTransport)
        assert _CountingTransport.launched.keys() >= {"reduce_scatter", "all_gather", "gather_copies", "all_reduce"}
        if ep > 1:
            assert _CountingTransport.launched.keys() >= {"all_to_all", "exchange_counts"}
    return True


def test_torch_collectives_serve_every_group_in_place_of_pipes_and_rings():
    assert run_distributed(_torch_collectives, 2) == [True, True]


def test_exactness_matrix_two_ranks():
    assert run_distributed(_matrix, 2, (1, 2), timeout=900) == [12 * len(ZERO_STAGES)] * 2


def test_exactness_matrix_four_ranks():
    """ep 2 on 4 ranks: dense params sharded 4 ways and each expert's over its 2 replicas, in one run (ep 1 on 4
    ranks, every param sharded 4 ways, takes the dense params' path: half the time for nothing new)."""
    assert run_distributed(_matrix, 4, (2,), timeout=1200) == [6 * len(ZERO_STAGES)] * 4
