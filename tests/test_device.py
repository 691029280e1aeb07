"""Training batches are built on the policy's device.

No GPU here, so the GPU situation is rebuilt on the CPU: the model's parameters on the CPU while a tensor
created without a device lands on `meta` (torch.set_default_device). A batch built on the default device,
the bug on a GPU, then reaches the model on `meta`; every call of token_logprobs is checked to receive its
tensors on the model's device. AdamW is swapped for SGD: it keeps its step counter on the default device
(the CPU on a GPU machine), which `meta` cannot read.
"""

import copy
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import arpo
import loop
import t2po
from common import run
from common.models import TINY_MODEL, load_policy


@pytest.fixture(scope="module")
def tiny():
    return load_policy(TINY_MODEL)


@pytest.fixture
def default_device_elsewhere(monkeypatch):
    """Yields `checked(module)`: patch module.token_logprobs to assert that every tensor it gets sits on
    the model's device; the body runs with `meta` as the default device."""
    def checked(module):
        real = module.token_logprobs

        def token_logprobs(model, *tensors, **kw):
            device = next(model.parameters()).device
            given = list(tensors) + [v for v in kw.values() if isinstance(v, torch.Tensor)]
            assert all(t.device == device for t in given), [t.device for t in given]
            calls.append(device)
            return real(model, *tensors, **kw)
        monkeypatch.setattr(module, "token_logprobs", token_logprobs)

    calls: list = []
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, **kw: torch.optim.SGD(params, lr))
    torch.set_default_device("meta")
    try:
        yield checked, calls
    finally:
        torch.set_default_device(None)


def test_arpo_update_and_cold_start_feed_the_model_on_its_device(tiny, default_device_elsewhere):
    checked, calls = default_device_elsewhere
    checked(arpo)
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    device = next(model.parameters()).device
    rollouts = [arpo.Rollout(0, response_ids=[11, 12, 12], action_mask=[1, 0, 1]),
                arpo.Rollout(0, response_ids=[15], action_mask=[1])]
    advantages = [[1.0] * 3, [-1.0]]
    batch = arpo.build_batch([[5, 6, 7]], rollouts, advantages, tokenizer.pad_token_id, device=device)
    # minibatches 2: pi_old recomputed; kl_coef > 0: the reference's forward too
    args = arpo.Args(minibatches=2, micro_batch_size=1, kl_coef=0.1)
    stats = arpo.update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, args, random.Random(0),
                        reference=copy.deepcopy(model))
    assert np.isfinite(stats["loss"]) and len(calls) == 2 * 2 + 2  # old, ref per row; one per mini-batch

    class OneExpert:  # one question, whose scripted expert writes a call, gets its result and answers
        def reset(self, task):
            return "Q?", {}

        def expert_demo(self, question):
            return [("<python>1</python>", 1), (" <result>\n1\n</result>", 0), ("<answer>1</answer>", 1)]

        def step(self, response):
            return "", 1.0, True, {"won": True}

    r = SimpleNamespace(model=model, policy=model, tokenizer=tokenizer, device=device,
                        generator=SimpleNamespace(update_weights=lambda model: None))
    arpo.cold_start(r, OneExpert(), [0, 1], arpo.Args(cold_start_lr=0.0, cold_start_episodes=2))
    assert len(calls) == 7  # one SFT forward: both demonstrations in one micro-batch


def test_t2po_update_and_rft_feed_the_model_on_its_device(tiny, default_device_elsewhere):
    checked, calls = default_device_elsewhere
    checked(t2po)
    model = copy.deepcopy(tiny[0])
    samples = [t2po.Turn([11, 12, 13], [21, 22, 23], action_mask=[1, 1, 1], advantage=1.0),
               t2po.Turn([11, 12], [31, 32], action_mask=[1, 0], advantage=-1.0)]
    # minibatch_size 1: two minibatches, pi_old recomputed for the second (the first trains on its own
    # forward); kl_coef > 0: the reference's forward on both
    args = t2po.Args(lr=0.0, minibatch_size=1, micro_batch_size=1, kl_coef=0.1)
    stats = t2po.update(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, args,
                        np.random.default_rng(0), reference=copy.deepcopy(model))
    assert np.isfinite(stats["loss"]) and len(calls) == 1 + 2 + 2
    log_likelihood = lambda rows: t2po.sft_log_likelihood(model, [samples[i] for i in rows], True)
    loss = run.sft(model, 2, log_likelihood,
                   lr=0.0, weight_decay=0.0, max_grad_norm=1.0, epochs=1, micro_batch_size=1,
                   permute=lambda n: [0, 1])
    assert np.isfinite(loss) and len(calls) == 7


def test_loop_recompute_feeds_the_model_on_its_device(tiny, default_device_elsewhere):
    # loop.py moved its batches to the model's device already (its update and SFT draw their order from a
    # CPU torch.Generator, which `meta` as the default device breaks: not run here)
    checked, calls = default_device_elsewhere
    checked(loop.logprobs)
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    rollouts = [loop.Rollout(task=None, group=0, sample=k, ids=[5, 6, 7, 8], turn_ids=[-1, -1, 0, 0],
                             action_mask=[False, False, True, True]) for k in range(2)]
    loop.recompute_logprobs(model, rollouts, tokenizer.pad_token_id, micro=1, key="old_logp")
    assert len(calls) == 2 and len(rollouts[0].old_logp) == 3
