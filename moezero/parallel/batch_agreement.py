"""The ranks that share micro-batches (a tp group's and a cp group's: Megatron's tp-cp) check that they hold the
same ones, before the step's first exchange.

Megatron loads a micro-batch on tp rank 0 and broadcasts it; moezero's tp and cp ranks each load their own (the same
sample indices, dealt by their common dp rank). A data path that diverges on one rank (another file, another
sequence length, a loader that yields one more micro-batch) would make the group's exchanges pair tensors of
different micro-batches: tp_regions.py's all-reduces, all-gathers and reduce-scatters, vocab_parallel.py's max and
sum, context_parallel.py's K/V all-gather, its reduce-scatter and a2a. Sizes that differ end in a transport's error
or gloo's abort; one more micro-batch on one rank waits for the group's timeout; equal sizes silently mix.

None of those exchanges carries a record of its own, and none needs one: each follows from the micro-batch the step
runs (its shape fixes every exchange's size, the count of micro-batches the number of forwards and backwards, the
model, the same on every rank and checked by ZeRO, their order). So one record per micro-batch, stating the
iteration, the micro-batch's place (j of n), its shape and a digest of its token ids, agreed over the group before
the step's first collective, makes each of them pair with its peer's; when any differs, every rank raises
`RanksDisagree` naming its micro-batch and another rank's. The records are launched as the step begins (8 to a
message, agreement.py), through the group's pipes when its ranks share a host, and checked before its first
collective. What the exchanges do with agreed inputs (the same on every rank) is the model's to keep deterministic.

An evaluation reads its micro-batches one at a time (their count is the loader's): each is agreed before its forward
(`EVALUATION` in the count's place), and its end too (`EVALUATION_END`, the micro-batches it read), so a rank that
reads one more than its peers meets their end record and every rank raises. A pipeline's evaluation
(training/pipeline_step.py) reads a global batch's micro-batches at once and runs them through the stages together:
their records, each stating the global batch's count too (`evaluation_count`), are agreed before its schedule, so a
rank given one more meets its peers' differing count before any exchange of the schedule.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from moezero.parallel.agreement import RECORDS_PER_MESSAGE, Agreement, agree

_DIGEST_MASK = (1 << 64) - 1
_MULTIPLIER = 0x9E3779B1  # odd: distinct positions weigh a token differently (a swap changes the digest)
EVALUATION = -1  # a record's count: an evaluation's micro-batch (their count unknown ahead)
EVALUATION_END = -2  # a record's count: an evaluation ended, after `index` micro-batches
_EVALUATION_GLOBAL_BATCH = -3  # a record's count at or below it: an evaluation's global batch of (it - count) ones


def evaluation_count(global_batch: int) -> int:
    """A record's count for a micro-batch of an evaluation's global batch of `global_batch` micro-batches."""
    return _EVALUATION_GLOBAL_BATCH - global_batch


def token_digest(tokens: torch.Tensor) -> int:
    """A cheap position-weighted sum of the token ids (int64, wrapping): equal for equal tokens, differing for
    a change of any token, or of their order, but for contrived collisions."""
    flat = tokens.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), dtype=torch.int64) * _MULTIPLIER + 1
    return int((flat * weights).sum()) ^ flat.numel()


def micro_batch_record(iteration: int, index: int, count: int, batch: Dict[str, torch.Tensor]) -> List[int]:
    """Micro-batch `index` of `count` of step `iteration`: (iteration, index, count, rows, sequence, digest)."""
    tokens = batch["tokens"]  # (rows, sequence)
    return [iteration, index, count, tokens.shape[0], tokens.shape[-1], token_digest(tokens)]


def describe_micro_batch(record: Sequence[int]) -> str:
    iteration, index, count, rows, sequence, digest = record
    if count == EVALUATION_END:
        return f"had ended the evaluation at iteration {iteration} after {index} micro-batches"
    if count == EVALUATION:
        place = f"evaluation micro-batch {index + 1}"
    elif count <= _EVALUATION_GLOBAL_BATCH:
        place = f"evaluation micro-batch {index + 1} (of a global batch of {_EVALUATION_GLOBAL_BATCH - count})"
    else:
        place = f"micro-batch {index + 1} of {count}"
    return (
        f"was at iteration {iteration}, {place}: tokens ({rows}, {sequence}) token digest {digest & _DIGEST_MASK:#018x}"
    )


class SharedBatchCheck:
    """The records of a step's micro-batches, launched now on `group` (the ranks sharing them; None or one rank:
    nothing to check); `check()` waits for every rank's and raises `RanksDisagree` on a difference."""

    def __init__(
        self,
        group: Optional[Any],
        iteration: int,
        micro_batches: Sequence[Dict[str, torch.Tensor]],
        evaluated_before: Optional[int] = None,
    ):
        """`evaluated_before`: the micro-batches are an evaluation's global batch, after that many of its
        micro-batches (their records count on from it and state the global batch's count: `evaluation_count`)."""
        self.agreements: List[Agreement] = []
        if group is None:
            return
        n = len(micro_batches)
        first, count = (0, n) if evaluated_before is None else (evaluated_before, evaluation_count(n))
        records = [micro_batch_record(iteration, first + j, count, batch) for j, batch in enumerate(micro_batches)]
        for first in range(0, n, RECORDS_PER_MESSAGE):
            chunk = records[first : first + RECORDS_PER_MESSAGE]
            self.agreements.append(Agreement(chunk, group, describe_micro_batch))

    def check(self) -> None:
        agreements, self.agreements = self.agreements, []
        for agreement in agreements:
            agreement.check()


def agree_evaluation_batch(group: Optional[Any], iteration: int, index: int, batch: Dict[str, torch.Tensor]) -> None:
    """Before an evaluation's micro-batch `index` (collective over `group`; None: nothing to check)."""
    if group is not None:
        agree(micro_batch_record(iteration, index, EVALUATION, batch), group, describe_micro_batch)


def agree_evaluation_end(group: Optional[Any], iteration: int, count: int) -> None:
    """After an evaluation's `count` micro-batches, before its sums (collective over `group`)."""
    if group is not None:
        agree([iteration, count, EVALUATION_END, 0, 0, 0], group, describe_micro_batch)
