"""Per-sample keyed draws (moezero/keyed_random.py): one stream per sample, made on the device they are used on."""

import pytest
import torch

import moezero.keyed_random as keyed_random
from moezero.keyed_random import SampleKeys, keyed_dropout, keyed_seed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_sample_draws_the_same_numbers_in_any_batch(device):
    """The layout contract: a sample's mask and jitter do not depend on which samples share its micro-batch."""
    both = SampleKeys(7, 3, (5, 9))
    alone = [SampleKeys(7, 3, (5,)), SampleKeys(7, 3, (9,))]
    mask = both.dropout_mask("attn", (4, 33), 0.25, device)
    assert mask.device.type == device and mask.shape == (2, 4, 33)
    assert torch.equal(mask, torch.cat([k.dropout_mask("attn", (4, 33), 0.25, device) for k in alone]))
    noise = both.uniform("jitter", (17,), 0.9, 1.1, device)
    assert torch.equal(noise, torch.cat([k.uniform("jitter", (17,), 0.9, 1.1, device) for k in alone]))
    normal = both.normal("force", (3, 5), device)
    assert torch.equal(normal, torch.cat([k.normal("force", (3, 5), device) for k in alone]))
    # another site, iteration or seed: other numbers
    for other in (
        both.dropout_mask("mlp", (4, 33), 0.25, device),
        SampleKeys(7, 4, (5, 9)).dropout_mask("attn", (4, 33), 0.25, device),
        SampleKeys(8, 3, (5, 9)).dropout_mask("attn", (4, 33), 0.25, device),
    ):
        assert not torch.equal(other, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_a_mask_is_the_device_generator_keyed_by_the_sample(device):
    """Each sample's numbers are its device's own generator seeded with the sample's key (no CPU stream copied
    over), and the mask keeps 1 - p of the values, scaled by 1 / (1 - p), as nn.Dropout."""
    keys, p = SampleKeys(11, 2, (0, 1)), 0.1
    mask = keys.dropout_mask("embedding", (64, 256), p, device)
    for b, sample in enumerate(keys.sample_ids):
        g = torch.Generator(device=device).manual_seed(keyed_seed(11, 2, sample, "embedding"))
        uniform = torch.empty(64, 256, device=device).uniform_(0.0, 1.0, generator=g)
        assert torch.equal(mask[b], (uniform >= p).float() / (1 - p))
    assert torch.equal(mask.unique().cpu(), torch.tensor([0.0, 1 / (1 - p)]))
    assert abs((mask > 0).float().mean().item() - (1 - p)) < 0.01


def test_keyed_dropout_draws_where_its_input_lives(monkeypatch):
    """A GPU activation's mask is drawn on the GPU: every generator keyed_dropout makes is on x's device."""
    seen = []
    real = keyed_random.keyed_generator

    def recording(*keys, device="cpu"):
        seen.append(torch.device(device).type)
        return real(*keys, device=device)

    monkeypatch.setattr(keyed_random, "keyed_generator", recording)
    for device in DEVICES:
        seen.clear()
        x = torch.ones(3, 8, 5, device=device)
        y = keyed_dropout(x, 0.5, True, SampleKeys(1, 1, (4, 5, 6)), "site")
        assert y.device.type == device and seen == [device] * 3
        assert torch.equal(y, x * SampleKeys(1, 1, (4, 5, 6)).dropout_mask("site", (8, 5), 0.5, device))


@pytest.mark.gpu
def test_a_gpu_draws_its_own_stream():
    """A GPU's masks come from its Philox generator: not the CPU's numbers for the same key, yet as many kept."""
    keys = SampleKeys(3, 1, (0, 1, 2))
    cpu, gpu = keys.dropout_mask("attn", (128, 128), 0.1), keys.dropout_mask("attn", (128, 128), 0.1, "cuda")
    assert not torch.equal(cpu, gpu.cpu())
    assert abs((gpu > 0).float().mean().item() - (cpu > 0).float().mean().item()) < 0.01


def test_each_dropout_of_a_forward_draws_from_its_own_site(monkeypatch):
    """Every dropout and jitter draw of one forward has a site of its own: two sites sharing a key would drop the
    same positions twice (correlated masks)."""
    from moezero.config import GPTConfig, MoEConfig
    from moezero.models import GPTModel

    sites = {}
    per_sample = SampleKeys._per_sample

    def spy(self, site, *args):
        sites[site] = sites.get(site, 0) + 1
        return per_sample(self, site, *args)

    monkeypatch.setattr(SampleKeys, "_per_sample", spy)
    config = GPTConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        seq_length=8,
        vocab_size=50,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        moe_layer_freq=2,
    )
    model = GPTModel(config, MoEConfig(num_experts=4, top_k=2, input_jitter_eps=0.1), seed=1).train()
    model(torch.randint(0, 50, (2, 8)), SampleKeys(0, 1, (0, 1)))
    assert len(sites) >= 2 * 3 + 1 and set(sites.values()) == {1}, sites
