"""Text generation from a GPT model: temperature, top-k and nucleus (top-p) sampling, or greedy.

    new_ids = generate(model, prompt_ids, max_new_tokens=50, temperature=0.8, top_k=40, top_p=0.95,
                       generator=torch.Generator().manual_seed(0), vocab_size=tokenizer.vocab_size)

One full forward per new token over the last max_position_embeddings tokens (no KV cache: these models
are small). On an expert-parallel model every rank calls it with the same prompt and generator seed:
each forward is a collective there, and equal logits give equal choices. At ZeRO stage 3 the forward
gathers its params itself.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


@torch.no_grad()
def generate(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    vocab_size: Optional[int] = None,
    stop_token: Optional[int] = None,
) -> List[int]:
    """The new token ids after `prompt` (not repeated); stops early after `stop_token`.

    temperature 0 is greedy; top_k 0 and top_p 1 (or 0, Megatron's "off") keep every token; only the
    first `vocab_size` logits are candidates (the model's vocabulary is padded past the tokenizer's).
    """
    if not prompt:
        raise ValueError("generate needs a prompt of at least one token")
    was_training = model.training
    model.eval()
    window = model.config.max_position_embeddings
    device = model.embedding.weight.device
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits, _ = model(torch.tensor([tokens[-window:]], device=device))
        next_id = sample_next(logits[0, -1, :vocab_size].float().cpu(), temperature, top_k, top_p, generator)
        tokens.append(next_id)
        if next_id == stop_token:
            break
    model.train(was_training)
    return tokens[len(prompt) :]


def sample_next(
    logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Optional[torch.Generator]
) -> int:
    """One token id from the last position's logits."""
    if temperature == 0:
        return int(logits_V.argmax())
    logits_V = logits_V / temperature
    if 0 < top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits_V.sort(descending=True)
        probs = torch.softmax(sorted_logits, -1)
        outside = probs.cumsum(-1) - probs > top_p  # the smallest set whose mass reaches top_p stays
        logits_V = logits_V.clone()
        logits_V[order[outside]] = float("-inf")
    probs = torch.softmax(logits_V.double(), -1)
    return int(torch.multinomial(probs, 1, generator=generator))
