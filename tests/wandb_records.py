"""Read a W&B run's .wandb file back (what an offline run writes): its history rows, {step: {key: value}}.

The file is a LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB blocks of records, each with a 7-byte
header: CRC, length, type; a record may span blocks as FIRST, MIDDLE..., LAST) of wandb's Record protobufs."""

import glob
import json
import os
import struct
from typing import Dict, Iterator

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a .wandb file"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER:  # the block's tail is padding
            position += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[position + 4 : position + HEADER])
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind in (FIRST, MIDDLE):
            pending = (b"" if kind == FIRST else pending) + chunk
        elif kind == LAST:
            yield pending + chunk
        else:  # zero padding at the end of a block or file
            position += BLOCK - position % BLOCK if position % BLOCK else 0


def history(run_dir: str) -> Dict[int, Dict[str, float]]:
    """{step: {key: value}} of the offline run written under `run_dir` (the newest, if several)."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    assert files, f"no offline W&B run under {run_dir}"
    with open(files[-1], "rb") as f:
        data = f.read()
    rows: Dict[int, Dict[str, float]] = {}
    kinds = []
    for blob in _records(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        kinds.append(record.WhichOneof("record_type"))
        if kinds[-1] != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.pop("_step", record.history.step.num))
        rows.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    assert rows, f"no history in {files[-1]} ({len(data)} bytes; records: {kinds})"
    return rows
