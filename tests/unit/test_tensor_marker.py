"""TensorShard: which global elements a tensor-parallel shard holds, against torch's own chunking of the global
tensor (split into the fused parts, each chunked over the ranks), and its local -> global flat ranges against the
shard of a global arange."""

import itertools
import math

import pytest
import torch

from moezero.parallel.tensor_marker import TensorShard, is_tensor_parallel, mark_tensor_parallel, tensor_shard_of
from moezero.parallel.tp_linear import ColumnParallelLinear, RowParallelLinear, global_linear_init
from moezero.parallel.vocab_parallel import VocabParallelEmbedding

CASES = [  # global shape, dim, parts
    ((8, 3), 0, None),  # column-parallel weight
    ((3, 8), 1, None),  # row-parallel weight
    ((16, 3), 0, (8, 4, 4)),  # fused [q | k | v] with GQA
    ((8, 3), 0, (4, 4)),  # GLU fc1 [gate | up]
    ((2, 8, 3), 1, (4, 4)),  # stacked experts' GLU w1 under ETP
    ((2, 3, 4), 2, None),  # stacked experts' w2 under ETP
    ((12,), 0, None),  # a column-parallel bias
]


def _torch_chunked(global_tensor, dim, parts, rank, size):
    """The oracle: torch.split into the parts, torch.chunk each over the ranks, rank's pieces concatenated."""
    pieces = global_tensor.split(list(parts or (global_tensor.shape[dim],)), dim)
    return torch.cat([piece.chunk(size, dim)[rank] for piece in pieces], dim)


@pytest.mark.parametrize("shape, dim, parts", CASES)
def test_shards_are_torchs_chunks_and_cover_the_tensor_once(shape, dim, parts):
    values = torch.arange(math.prod(shape)).view(shape)
    for size in (1, 2, 4):
        if any(p % size for p in parts or (shape[dim],)):
            continue
        held = []
        for rank in range(size):
            shard = TensorShard.split(shape, dim, rank, size, parts)
            local = shard.local_of(values)
            assert local.is_contiguous() and tuple(local.shape) == shard.local_shape
            assert torch.equal(local, _torch_chunked(values, dim, parts, rank, size))
            held.append(local.flatten())
        assert torch.equal(torch.cat(held).sort().values, values.flatten())


@pytest.mark.parametrize("shape, dim, parts", CASES)
def test_local_flat_ranges_map_to_the_global_elements(shape, dim, parts):
    values = torch.arange(math.prod(shape)).view(shape)
    shard = TensorShard.split(shape, dim, 1, 2, parts)
    local = shard.local_of(values).flatten()
    for lo, hi in itertools.combinations_with_replacement(range(local.numel() + 1), 2):
        ranges = shard.global_flat_ranges(lo, hi)
        assert all(a < b for a, b in ranges)
        assert all(prev[1] != nxt[0] for prev, nxt in zip(ranges, ranges[1:])), "adjacent ranges not merged"
        mapped = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(mapped, local[lo:hi]), (lo, hi, ranges)


def test_dim0_ranges_are_one_per_block_crossed():
    qkv = TensorShard.split((16, 3), 0, 1, 2, (8, 4, 4))  # rank 1: q rows 4-7, k rows 10-11, v rows 14-15
    assert qkv.blocks == ((4, 8), (10, 12), (14, 16))
    assert qkv.global_flat_ranges(0, 8 * 3) == [(12, 24), (30, 36), (42, 48)]
    assert qkv.global_flat_ranges(5, 14) == [(17, 24), (30, 32)]
    row = TensorShard.split((3, 8), 1, 0, 2)  # one range per row of the (3, 4) local weight
    assert row.global_flat_ranges(0, 12) == [(0, 4), (8, 12), (16, 20)]
    whole = TensorShard.split((3, 8), 1, 0, 1)
    assert whole.global_flat_ranges(2, 20) == [(2, 20)]


def test_refusals():
    with pytest.raises(ValueError, match=r"parts \(6, 2\) of dim 0 of \(8, 3\) do not split over 4 ranks"):
        TensorShard.split((8, 3), 0, 0, 4, (6, 2))
    with pytest.raises(ValueError, match="do not add up"):
        TensorShard.split((8, 3), 0, 0, 2, (4, 2))
    with pytest.raises(ValueError, match="do not lie in"):
        TensorShard((8, 3), 0, ((6, 10),))
    with pytest.raises(ValueError, match="outside a shard"):
        TensorShard.split((8, 3), 0, 0, 2).global_flat_ranges(0, 13)
    with pytest.raises(ValueError, match="global tensor shaped"):
        TensorShard.split((8, 3), 0, 0, 2).local_of(torch.zeros(3, 8))
    param = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="not the shard"):
        mark_tensor_parallel(param, TensorShard.split((8, 3), 1, 0, 1))
    assert tensor_shard_of(param) is None and not is_tensor_parallel(param)
    mark_tensor_parallel(param, TensorShard.split((8, 3), 0, 0, 2))
    assert tensor_shard_of(param).blocks == ((0, 4),)


def test_one_rank_layers_start_as_torchs():
    """Without a group the layers are torch's nn.Linear and nn.Embedding, drawn from the same generator calls,
    and tagged as whole shards."""
    torch.manual_seed(3)
    linear, embedding = torch.nn.Linear(5, 6), torch.nn.Embedding(7, 5)
    torch.manual_seed(3)
    column, embedding_shard = ColumnParallelLinear(5, 6, None), VocabParallelEmbedding(7, 5, None)
    torch.manual_seed(3)
    row = RowParallelLinear(5, 6, None)
    for ours in (column, row):
        assert torch.equal(ours.weight, linear.weight) and torch.equal(ours.bias, linear.bias)
        assert tensor_shard_of(ours.weight).blocks == ((0, ours.weight.shape[tensor_shard_of(ours.weight).dim]),)
    assert torch.equal(embedding_shard.weight, embedding.weight)
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(column(x), linear(x), rtol=0, atol=0)
    torch.testing.assert_close(row(x), linear(x), rtol=0, atol=0)
    weight, bias = global_linear_init(5, 6, bias=False)
    assert bias is None and weight.shape == (6, 5)


def test_refused_layer_settings():
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        RowParallelLinear(4, 4, None, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="a global bias is given exactly when the layer has one"):
        ColumnParallelLinear(4, 4, None, bias=False).copy_from_global_(torch.zeros(4, 4), torch.zeros(4))


def test_the_gathered_order_of_fused_parts_moves_with_the_layer():
    """A column-parallel layer gathering fused parts keeps their global order as a buffer: it follows .to() (a
    device move; here the meta device) and stays out of the state dict."""
    layer = ColumnParallelLinear(4, 6, None, gather_output=True, parts=(2, 4))
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert layer.to("meta")._global_order.device.type == "meta"
