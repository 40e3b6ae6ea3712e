"""One shared-memory ring of `moezero/parallel/local_exchange.py`, sender and receiver in one process: an empty
ring that started over at its start keeps the rest of its room while that message is unread (the skipped tail
holds no data), and never lets a message overwrite one still unread."""

import platform

import pytest
import torch

from moezero.parallel import local_exchange

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in local_exchange._ORDERED_STORES,
    reason="shared-memory rings only on x86 hosts (gloo elsewhere)",
)


def _message(n, value):
    return torch.full((n,), value, dtype=torch.uint8)


def _received(receiver, span, n):
    out = torch.empty(n, dtype=torch.uint8)
    receiver.take(span[0], span[1], n, out)
    return out


def test_a_ring_that_started_over_keeps_its_room_and_its_unread_bytes(tmp_path):
    capacity = 1024
    path = str(tmp_path / "ring")
    sender = local_exchange._make_ring(path, capacity)
    receiver = local_exchange._map_ring(path, capacity)
    try:
        assert torch.equal(_received(receiver, sender.place(_message(128, 1)), 128), _message(128, 1))
        first = sender.place(_message(64, 2))  # the ring is empty 128 bytes in: it starts over at its start
        second = sender.place(_message(512, 3))  # 896 bytes skipped, none of them data: room for this one
        third = sender.place(_message(448, 4))  # up to the ring's end exactly
        assert None not in (first, second, third)
        assert sender.place(_message(1, 5)) is None  # from the start again: onto the unread first message
        assert torch.equal(_received(receiver, first, 64), _message(64, 2))
        assert torch.equal(_received(receiver, second, 512), _message(512, 3))
        fourth = sender.place(_message(576, 6))  # where the first two were
        assert fourth is not None
        assert torch.equal(_received(receiver, third, 448), _message(448, 4))
        assert torch.equal(_received(receiver, fourth, 576), _message(576, 6))
    finally:
        receiver.close()
        sender.close()
