"""Llama: the dense decoder every family here builds on, and a source of upcycling (--moe-use-upcycling)."""

from __future__ import annotations

from moezero.hf.decoder import DECODER, DENSE_WIDTH, SWIGLU, GroupedQueryAttention, no_attention_bias
from moezero.hf.family import Family
from moezero.hf.rope_fields import Rope

LLAMA = Family(
    "llama",
    "LlamaForCausalLM",
    dense=True,
    parts=(*DECODER, SWIGLU, DENSE_WIDTH, GroupedQueryAttention(), Rope(), no_attention_bias()),
)
