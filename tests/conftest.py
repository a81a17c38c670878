"""Shared fixtures: tiny random models of several architectures and the embedded SmolLM2."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from .tiny_models import TINY_ARCHS, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def smol_dir():
    from kvboost.loading import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def smol(smol_dir):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU, loaded once per session."""
    from kvboost.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(None)


@pytest.fixture(params=TINY_ARCHS)
def tiny(request, tokenizer):
    return make_tiny_model(request.param, tokenizer), tokenizer
