"""Every way a prompt comes in ends as validated token ids, or as InvalidRequestError naming the parameter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvboost import InvalidRequestError
from kvboost.prompting import check_token_ids, encode_prompt

VOCAB = 100


@pytest.mark.parametrize("ids", [[1, 2, 3], (1, 2, 3), torch.tensor([1, 2, 3]), torch.tensor([[1, 2, 3]]),
                                 np.array([1, 2, 3]), [np.int64(1), 2, 3]])
def test_token_id_sequences_of_any_kind_become_plain_ints(ids):
    out = check_token_ids(ids, VOCAB)
    assert out == [1, 2, 3] and all(type(t) is int for t in out)


def test_token_ids_on_the_test_device_are_accepted(device):
    assert check_token_ids(torch.tensor([[1, 2, 3]], device=device), VOCAB) == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="one sequence"):
        check_token_ids(torch.tensor([1.0, 2.0], device=device), VOCAB)


@pytest.mark.parametrize("ids, match", [
    ([], "empty"),
    ([0, VOCAB], r"input_ids\[1\] = 100 is outside"),
    ([-1], "outside"),
    ([1.0], "must be integers"),
    ([False], "must be integers"),
    ([[1, 2]], "must be integers"),
    (torch.tensor([[1, 2], [3, 4]]), "one sequence"),
    (torch.tensor([1.0, 2.0]), "one sequence"),
    ("12", "sequence of integer token ids"),
    (7, "sequence of integer token ids"),
    ({"input_ids": [1]}, "sequence of integer token ids"),
])
def test_bad_token_ids_are_rejected_with_the_reason(ids, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        check_token_ids(ids, VOCAB)
    assert info.value.param == "input_ids"


def test_only_one_kind_of_prompt_at_a_time(tokenizer):
    with pytest.raises(InvalidRequestError, match="one of prompt, messages or input_ids"):
        encode_prompt(tokenizer, len(tokenizer), messages=[{"role": "user", "content": "x"}], input_ids=[1])
    assert encode_prompt(tokenizer, len(tokenizer), input_ids=[5, 6]) == [5, 6]
    assert encode_prompt(tokenizer, len(tokenizer), "hello") == tokenizer("hello")["input_ids"]
