from __future__ import annotations

import torch

from kvboost.sampling import Sampler, SamplingParams, find_stop, held_back_length

from .devices import assert_on


def test_greedy_is_argmax(device):
    logits = torch.tensor([0.1, 3.0, 2.0], device=device)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == 1
    assert Sampler(SamplingParams(temperature=0.7, do_sample=False))(logits) == 1


def test_seeded_sampling_reproducible_and_seed_sensitive(device):
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0)).to(device)
    draw = lambda seed: [Sampler(SamplingParams(temperature=1.0, seed=seed))(logits) for _ in range(1)]  # noqa: E731
    s1 = Sampler(SamplingParams(temperature=1.0, seed=7))
    s2 = Sampler(SamplingParams(temperature=1.0, seed=7))
    a = [s1(logits) for _ in range(20)]
    assert a == [s2(logits) for _ in range(20)]
    s3 = Sampler(SamplingParams(temperature=1.0, seed=8))
    assert a != [s3(logits) for _ in range(20)]
    assert draw(1) == draw(1)


def test_top_k_and_top_p_restrict_support(device):
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0], device=device)
    p = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(logits)
    assert_on(device, p)
    assert p[2] == 0 and p[3] == 0 and abs(p.sum().item() - 1) < 1e-6
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.5)).probabilities(logits)
    assert p[0] == 1.0  # the top token alone already holds more than half the mass


def test_a_seed_draws_the_same_tokens_on_every_device(device):
    """Sampling runs on a CPU generator, so device logits draw what the same logits draw on the CPU."""
    logits = torch.linspace(-2.0, 2.0, 64)  # exactly representable: the same softmax input everywhere
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    on_cpu, on_device = Sampler(params), Sampler(params)
    assert [on_device(logits.to(device)) for _ in range(10)] == [on_cpu(logits) for _ in range(10)]


def test_stop_helpers():
    assert find_stop("hello world", ["wor", "xyz"]) == 6
    assert find_stop("hello", ["z"]) == -1
    assert held_back_length("answer: EN", ["END"]) == 2
    assert held_back_length("answer", ["END"]) == 0
