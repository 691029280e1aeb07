"""Training batches are built on the policy's device.

No GPU here, so the GPU situation is rebuilt on the CPU: the model's parameters on the CPU while a tensor
created without a device lands on `meta` (torch.set_default_device). A batch built on the default device,
the bug on a GPU, then reaches the model on `meta`; every call of token_logprobs is checked to receive its
tensors on the model's device. AdamW is swapped for SGD: it keeps its step counter on the default device
(the CPU on a GPU machine), which `meta` cannot read. Likewise the update's loss statistics, float64 tensors
made from Python numbers and reduced over ranks by gloo (common/dist.py), belong on the CPU: a float64
`torch.tensor` without a device keeps the CPU here (a batch's tensors are long and float32, and still land
on `meta`).
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._device import DeviceContext

import arpo
import loop
import t2po
from common.models import TINY_MODEL, load_policy


class MetaExceptStatistics(DeviceContext):
    """`meta` as the default device (torch.set_default_device's mode), but for float64 `torch.tensor`s,
    the CPU statistics the update reduces over ranks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.tensor and kwargs.get("dtype") is torch.float64 and kwargs.get("device") is None:
            kwargs["device"] = "cpu"
        return super().__torch_function__(func, types, args, kwargs)


@pytest.fixture(scope="module")
def tiny():
    return load_policy(TINY_MODEL)


@pytest.fixture
def default_device_elsewhere(monkeypatch):
    """Yields `checked(module)`: patch module.token_logprobs to assert that every tensor it gets sits on
    the model's device; the body runs with `meta` as the default device (MetaExceptStatistics)."""
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
    with MetaExceptStatistics("meta"):
        yield checked, calls


class OneExpert:
    """One question, which every script's scripted expert wins in one turn: arpo's expert_demo (a call, its
    result, the answer), loop's and t2po's expert_action (t2po's with a thought)."""

    def reset(self, task):
        return "Q?", {}

    def expert_demo(self, question):
        return [("<python>1</python>", 1), (" <result>\n1\n</result>", 0), ("<answer>1</answer>", 1)]

    def expert_action(self):
        return "go"

    def expert_thought(self, action, long=False):
        return "it is the way"

    def step(self, response):
        return "", 1.0, True, {"won": True}


SCRIPTS = {"arpo": arpo, "loop": loop, "t2po": t2po}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_update_and_cold_start_feed_the_model_on_its_device(name, tiny, default_device_elsewhere):
    """The shared skeleton's update (pi_old, pi_ref and the loss) and cold start (demonstrations, SFT) in
    each script; each calls its own `policy_loss` and `demonstrations`, so all three run."""
    script = SCRIPTS[name]
    checked, calls = default_device_elsewhere
    checked(script)
    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    device = next(model.parameters()).device
    samples = [script.TrainingSample((0,), [5, 6, 7], [11, 12, 12], [1, 0, 1], [1.0] * 3),
               script.TrainingSample((1,), [5, 6, 7], [15], [1], [-1.0])]
    # minibatch_size 1: two minibatches; pi_old is the first one's own forward, recomputed for the second
    # (1e3f13f: arpo recomputed both before, 2 calls; now 1); kl_coef > 0: the reference's forward on both
    args = script.Args(minibatch_size=1, micro_batch_size=1, ppo_epochs=1, kl_coef=0.1)
    stats = script.update(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, args,
                          np.random.default_rng(0), reference=copy.deepcopy(model))
    assert np.isfinite(stats["loss"]) and stats["gradient_steps"] == 2
    assert len(calls) == 1 + 2 + 2  # pi_old of the second minibatch, pi_ref of both, one per minibatch

    r = SimpleNamespace(model=model, policy=model, tokenizer=tokenizer, device=device,
                        generator=SimpleNamespace(update_weights=lambda model: None))
    envs = script.Envs(OneExpert(), {}, [0, 1], [], None, None, None)
    log = script.cold_start(r, envs, script.Args(cold_start_lr=0.0, cold_start_episodes=2, cold_start_epochs=1))
    assert log["cold_start/samples"] >= 2 and np.isfinite(log["cold_start/loss"])
    assert len(calls) == 5 + 1  # one SFT forward: both demonstrations in one micro-batch
