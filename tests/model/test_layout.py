"""Input-major linear weights (model/layout.py): same values and outputs, tied weights stay tied."""
from __future__ import annotations

import torch

from kvboost.model.layout import input_major_linears, is_input_major

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
