"""Generation against rules written independently of moezero/models/sampling.py: greedy decoding is the
argmax of the model's logits step by step; sampling picks only the tokens top-k / top-p allow and, over
many draws with a fixed seed, follows the renormalised softmax(logits / temperature) (a chi-square test).
"""

import math

import pytest
import torch

from moezero.config import GPTConfig
from moezero.models import GPTModel, generate
from moezero.models.sampling import sample_next

VOCAB, USABLE = 40, 37  # the model's vocabulary is padded past the tokenizer's 37 tokens
LOGITS = torch.tensor([2.1, -0.3, 0.9, 1.7, -1.2, 0.4, 3.0, 0.0, 1.1, -0.8, 2.6, 0.2], dtype=torch.float64)
DRAWS = 20000


def test_greedy_is_the_argmax_of_the_logits_step_by_step():
    config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=16, vocab_size=VOCAB)
    model = GPTModel(config, seed=3).double()
    prompt = [3, 7, 1]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            logits, _ = model(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1, :USABLE].argmax()))
    assert generate(model, prompt, 10, temperature=0, vocab_size=USABLE) == tokens[len(prompt) :]
    stop = tokens[len(prompt) + 4]
    assert (
        generate(model, prompt, 10, temperature=0, vocab_size=USABLE, stop_token=stop)
        == tokens[len(prompt) : tokens.index(stop, len(prompt)) + 1]
    )
    assert model.training, "generate restores the training mode"


def _allowed(logits, temperature, top_k, top_p):
    """The rule, written here: top-k keeps the k largest logits; top-p then keeps the smallest set of the most
    likely remaining tokens whose probability (renormalised over them) reaches top_p."""
    order = [int(i) for i in torch.argsort(logits, descending=True)]
    keep = order[:top_k] if top_k else order
    if top_p < 1:
        probs = torch.softmax(logits[keep] / temperature, 0)
        mass, kept = 0.0, []
        for token, p in zip(keep, probs.tolist()):
            kept.append(token)
            mass += p
            if mass >= top_p:
                break
        keep = kept
    return sorted(keep)


def _chi_square_bound(df: int) -> float:
    """The 0.999 quantile of chi-square(df), Wilson-Hilferty (accurate to ~1% for df >= 2)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.8), (0.8, 6, 0.7)])
def test_sampling_picks_only_allowed_tokens_with_the_renormalised_probabilities(temperature, top_k, top_p):
    allowed = _allowed(LOGITS, temperature, top_k, top_p)
    expected = torch.softmax(LOGITS[allowed] / temperature, 0)
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(LOGITS.numel())
    for _ in range(DRAWS):
        counts[sample_next(LOGITS, temperature, top_k, top_p, generator)] += 1
    picked = sorted(int(i) for i in counts.nonzero())
    assert set(picked) <= set(allowed), (picked, allowed)
    chi2 = float(((counts[allowed] - DRAWS * expected) ** 2 / (DRAWS * expected)).sum())
    assert chi2 < _chi_square_bound(len(allowed) - 1), (chi2, allowed)
    assert len(picked) == len(allowed)  # every allowed token is reachable (none has a tiny probability here)
