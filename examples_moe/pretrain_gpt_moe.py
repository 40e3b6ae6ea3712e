#!/usr/bin/env python
"""Pretrain a GPT Mixture-of-Experts model (Megatron-style flags).

    torchrun --nproc_per_node=2 examples_moe/pretrain_gpt_moe.py --expert-model-parallel-size 2 --zero-stage 2
    python examples_moe/pretrain_gpt_moe.py          # one process, default small model, stdlib corpus

All flags: --help. The library does the work (moezero.recipe composes training and QAT); this file only
launches it.
"""

import os
import sys

# one thread per rank unless the launcher says otherwise (2 ranks on 2 cores must not oversubscribe)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from moezero.recipe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
