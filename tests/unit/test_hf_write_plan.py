"""The plan of a Hub export written by every rank: each tensor once, by a rank that holds it, shares balanced,
files within the size and numbered alike on every rank."""

from moezero.hf.write_plan import Piece, plan_writes


def _pieces():
    dense = [Piece(f"dense{i}", (0, 1, 2, 3), ((f"d{i}.a", 100 + i), (f"d{i}.b", 50))) for i in range(6)]
    experts = [
        Piece(f"w1@experts{j * 2}", (j, j + 2), tuple((f"e{j * 2 + e}", 300) for e in range(2))) for j in range(2)
    ]  # ep 2 on 4 ranks: ep rank j's experts live on ranks j and j + 2
    return dense + experts


def test_every_key_once_by_a_holder_in_files_within_the_size():
    pieces = _pieces()
    plan = plan_writes(pieces, world_size=4, max_shard_bytes=400)
    keys = [key for piece in pieces for key, _ in piece.keys]
    assert sorted(plan.file_of) == sorted(keys)
    written = [key for rank in range(4) for _, file_keys in plan.files(rank) for key in file_keys]
    assert sorted(written) == sorted(keys), "each key in exactly one rank's files"
    for piece in pieces:
        assert plan.writer[piece.name] in piece.holders
    sizes = {key: n for piece in pieces for key, n in piece.keys}
    for rank in range(4):
        for name, file_keys in plan.files(rank):
            assert sum(sizes[k] for k in file_keys) <= 400 or len(file_keys) == 1
            assert all(plan.file_of[k] == name for k in file_keys)
    assert len(set(plan.file_of.values())) == len(plan.names)
    assert all(name.endswith(f"-of-{len(plan.names):05d}.safetensors") for name in plan.names)


def test_the_shares_are_balanced_and_the_plan_is_the_same_everywhere():
    plan = plan_writes(_pieces(), world_size=4, max_shard_bytes=10**9)
    load = [0] * 4
    for piece in _pieces():
        load[plan.writer[piece.name]] += piece.nbytes
    assert max(load) - min(load) <= 600, load  # no more apart than the largest piece
    assert plan == plan_writes(_pieces(), world_size=4, max_shard_bytes=10**9)


def test_one_process_writes_everything():
    alone = [Piece(p.name, (0,), p.keys) for p in _pieces()]
    plan = plan_writes(alone, world_size=1, max_shard_bytes=10**9)
    assert set(plan.writer.values()) == {0} and plan.names == ["model-00001-of-00001.safetensors"]
