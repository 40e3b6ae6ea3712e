"""A checkpoint's pickles are read by unpicklers that run no code: its .metadata (DCP's index), the byte entries DCP
stores with torch.save, and moezero's train state and RNG states inside them. A planted pickle in any of them is a
CheckpointError, and never runs; what moezero writes reads back."""

import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from moezero.checkpoint import CheckpointError, keys, read_train_state
from moezero.checkpoint.safe_pickle import UnsafePickle, decode_blob, read_dcp_metadata


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _dcp_checkpoint(path, train_state):
    """A DCP checkpoint (no manifest: as written before checksums) whose train_state entry is `train_state`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({keys.TRAIN_STATE: train_state, "w": torch.ones(3)}, checkpoint_id=str(path), no_dist=True)
    return str(path)


@pytest.mark.parametrize("where", ["DCP's byte entry (torch.save)", "the train state (pickle.dumps)"])
def test_a_planted_pickle_in_a_shard_is_refused_and_never_runs(where, tmp_path):
    marker = str(tmp_path / "marker")
    planted = _Planted(marker) if where.startswith("DCP") else pickle.dumps(_Planted(marker))
    path = _dcp_checkpoint(tmp_path / "ckpt", planted)
    with pytest.raises(CheckpointError) as refused:
        read_train_state(path)
    assert len(str(refused.value).splitlines()) == 1 and not os.path.exists(marker)
    if not where.startswith("DCP"):
        assert "its train state is refused, it names builtins.exec" in str(refused.value)


def test_what_a_checkpoint_holds_reads_back(tmp_path):
    """The train state and RNG states moezero saves, and DCP's index, through the restricted unpicklers."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    back = decode_blob(keys.encode(rng))
    assert back["python"] == rng["python"] and torch.equal(back["torch"], rng["torch"])
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(back["numpy"], rng["numpy"])
    )
    state = {"iteration": 3, "configs": {"model": {"num_layers": 2, "betas": (0.9, 0.95), "none": None}}}
    path = _dcp_checkpoint(tmp_path / "ckpt", keys.encode(state))
    assert read_train_state(path)["configs"]["model"]["betas"] == (0.9, 0.95)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = read_dcp_metadata(f)
    assert metadata.state_dict_metadata["w"].size == torch.Size([3])


def test_the_metadata_reader_admits_dcp_classes_only():
    with pytest.raises(UnsafePickle, match="it names posix.system, which a checkpoint never holds"):
        decode_blob(b"cposix\nsystem\n(S'true'\ntR.")
    import io

    with pytest.raises(UnsafePickle, match="it holds a dict, not DCP's Metadata"):
        read_dcp_metadata(io.BytesIO(pickle.dumps({"a": 1})))
