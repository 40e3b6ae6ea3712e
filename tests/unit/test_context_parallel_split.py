"""The context-parallel split (moezero/context_parallel.py) against megatron-core's get_batch_on_this_cp_rank,
which reads only its group's size and rank (a stub object serves); and the sample keys of a cp rank, whose draws
are the slices of the whole sequence's."""

import pytest
import torch
from megatron.core import utils as mcore_utils

from moezero.keyed_random import SampleKeys
from moezero.context_parallel import (
    ContextParallel,
    HeadBlockKeys,
    QueryRowKeys,
    ShardedSampleKeys,
    chunk_positions,
    split_sequence,
)


class _StubGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp, seq", [(2, 8), (2, 32), (4, 32), (3, 12)])
def test_split_is_megatron_cores(cp, seq, monkeypatch):
    # megatron-core asks torch.distributed whether it is initialised before asking the group: no processes here
    monkeypatch.setattr(mcore_utils, "get_pg_size", lambda group: group.size())
    monkeypatch.setattr(mcore_utils, "get_pg_rank", lambda group: group.rank())
    g = torch.Generator().manual_seed(seq)
    batch = {
        "tokens": torch.randint(0, 50, (3, seq), generator=g),
        "labels": torch.randint(0, 50, (3, seq), generator=g),
        "loss_mask": torch.rand(3, seq, generator=g),
        "position_ids": torch.arange(seq).expand(3, seq),
    }
    for rank in range(cp):
        want = mcore_utils.get_batch_on_this_cp_rank(dict(batch), cp_group=_StubGroup(cp, rank))
        for key, value in batch.items():
            assert torch.equal(split_sequence(value, cp, rank), want[key]), (cp, rank, key)
        assert torch.equal(chunk_positions(seq, cp, rank), want["position_ids"][0])


def test_cp2_positions_of_eight_tokens():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_sharded_keys_draw_the_whole_sequences_slice():
    keys = SampleKeys(5, 2, (4, 9))
    positions = chunk_positions(16, 2, 1)
    sharded = ShardedSampleKeys(keys, positions, 16)
    whole = keys.dropout_mask("site", (16, 3), 0.3)
    assert torch.equal(sharded.dropout_mask("site", (8, 3), 0.3), whole[:, positions])
    every_head = keys.dropout_mask("attn", (4, 16, 16), 0.3)
    rows = QueryRowKeys(keys, positions, 16).query_rows_dropout_mask("attn", 4, 0.3, "cpu")  # all_gather
    assert torch.equal(rows, every_head[:, :, positions])
    tp_heads = HeadBlockKeys(keys, 4, slice(2, 4))  # a tp rank's heads, then all_gather's query rows
    rows = QueryRowKeys(tp_heads, positions, 16).query_rows_dropout_mask("attn", 2, 0.3, "cpu")
    assert torch.equal(rows, every_head[:, 2:4][:, :, positions])
    heads = tp_heads.of_block(slice(1, 2)).dropout_mask("attn", (1, 16, 16), 0.3)  # a2a's block of the tp rank's
    assert torch.equal(heads, every_head[:, 3:4])


def test_split_micro_batch_shifts_mtp_on_the_whole_sequence():
    """MTP's shifted tokens, labels and mask come from the whole sequence (a shift of the rank's part would pull in
    its other chunk's tokens); the whole micro-batch's loss tokens count the lm's and each depth's."""
    tokens = torch.arange(16).view(1, 16)
    mask = torch.ones(1, 16)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": mask, "sample_index": torch.tensor([0])}
    cp = ContextParallel(None)
    cp.size, cp.rank = 2, 0  # rank 0 of 2 without a group: the split needs no exchange
    split = cp.split_micro_batch(batch, 2)
    assert split.batch["tokens"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split.batch["mtp_tokens"][0].tolist() == [[1, 2, 3, 4, 13, 14, 15, 0]]
    assert split.batch["mtp_loss_mask"][1].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert split.whole_tokens.tolist() == [16.0, 15.0, 14.0]


def test_a_cp_model_refuses_mtp_without_the_whole_sequences_shift():
    """A cp rank's MTP tokens must be shifted before the split; forward without them says so, not a wrong loss."""
    from moezero.config import GPTConfig
    from moezero.models import GPTModel

    cp = ContextParallel(None)
    cp.size, cp.rank = 2, 0
    config = GPTConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=16,
        mtp_num_layers=1,
        position_embedding_type="rope",
    )
    model = GPTModel(config, context_parallel=cp)
    with pytest.raises(ValueError, match="shifted on the whole sequence"):
        model(torch.zeros(1, 4, dtype=torch.long), mtp=True)


@pytest.mark.parametrize("heads,groups,window", [(4, 4, None), (4, 2, None), (4, 2, 3)])
def test_a_cp_ranks_queries_attend_as_the_whole_sequences_rows(heads, groups, window, monkeypatch):
    """causal_attention with a cp rank's query positions over the whole sequence's keys and values gives the rows of
    one process's attention at those positions, float64: without a window through SDPA with a boolean mask (the
    explicit path, which forms every score, is not taken), with one through the explicit path; forward and every
    input's gradient."""
    from moezero.context_parallel import chunk_positions
    from moezero.models import attention
    from moezero.models.attention import causal_attention

    explicit = []
    original = attention._explicit_attention
    monkeypatch.setattr(attention, "_explicit_attention", lambda *a, **k: explicit.append(1) or original(*a, **k))

    g = torch.Generator().manual_seed(3)
    S, h = 16, 8
    q, k, v = (torch.randn(2, n, S, h, generator=g, dtype=torch.float64) for n in (heads, groups, groups))
    weights = torch.randn(2, heads, S, h, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = causal_attention(*full, 0.0, True, None, "attn", window=window)
    (whole * weights).sum().backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(2):
        positions = chunk_positions(S, 2, rank)
        part = [q[:, :, positions].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]
        rows = causal_attention(*part, 0.0, True, None, "attn", window=window, query_positions=positions)
        torch.testing.assert_close(rows, whole[:, :, positions], rtol=0, atol=1e-13)
        (rows * weights[:, :, positions]).sum().backward()
        dq[:, :, positions] = part[0].grad
        dk, dv = dk + part[1].grad, dv + part[2].grad  # the ranks' key/value gradients add up (cp's reduce-scatter)
    for ours, theirs in zip((dq, dk, dv), full):
        torch.testing.assert_close(ours, theirs.grad, rtol=0, atol=1e-13)
    assert len(explicit) == (3 if window else 0)  # one process's and the two ranks'
