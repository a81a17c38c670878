"""Linear weight layouts (model/layout.py): same values and outputs in either memory order, tied weights stay
tied, and the measured choice covers every shape and is applied."""
from __future__ import annotations

import torch

from kvboost.model.layout import fastest_linear_layouts, input_major_linears, is_input_major, relay_linears

from ..tiny_models import make_tiny_model


def test_relaid_model_computes_the_same_logits_and_keeps_ties(tokenizer):
    model = make_tiny_model("llama", tokenizer, device=torch.device("cpu"))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.tensor([[5, 9, 11, 300, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits.clone()
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    n = input_major_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert n == len({id(m.weight) for m in linears}) > 0
    assert all(is_input_major(m.weight) for m in linears)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still one tied parameter
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert input_major_linears(model) == 0  # already laid out: nothing to do


def test_each_shape_gets_its_measured_order_and_outputs_do_not_change(tokenizer):
    model = make_tiny_model("llama", tokenizer, device=torch.device("cpu"))
    ids = torch.tensor([[5, 9, 11, 300, 42]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits.clone()
    choice = fastest_linear_layouts(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = {(m.weight.shape[0], m.weight.shape[1], m.weight.dtype) for m in linears}
    assert set(choice) == shapes  # every distinct shape was measured
    for m in linears:
        assert is_input_major(m.weight) == choice[(m.weight.shape[0], m.weight.shape[1], m.weight.dtype)]
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    # Flipping every order back and forth keeps the values.
    assert relay_linears(model, lambda shape: not choice[shape]) == len({id(m.weight) for m in linears})
    assert relay_linears(model, lambda shape: choice[shape]) == len({id(m.weight) for m in linears})
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
