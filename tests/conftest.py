"""Fixtures the test files share: the tiny random-init model (unit tests only; the scripts' default model is
the packaged SmolLM2-135M-Instruct)."""

import copy

import pytest

from common.models import TINY_MODEL, load_policy


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny model and its tokenizer, loaded once per session: never train it, take `tiny_policy`."""
    return load_policy(TINY_MODEL)


@pytest.fixture
def tiny_policy(tiny_loaded):
    """A fresh copy of the tiny model (safe to update) and its tokenizer."""
    model, tokenizer = tiny_loaded
    return copy.deepcopy(model), tokenizer
