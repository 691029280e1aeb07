"""Masks and tokens on three tokenizer shapes (issue 23 §4). Each script's `main` runs one training step on a
tiny random model built here (no hub), and the test reads what its loss reads -- token rows, loss masks, old
log-probs: the batch each call of the script's `policy_loss(logp, batch, args)` gets from the shared
`build_batch` of its TrainingSamples -- against what the generator sampled:

- every token with loss mask 1 is a token the generator sampled after the same ids (ids, not text: a response
  decoded and re-encoded puts ids the policy never chose into the update);
- prompt, observation, tool-result and forced tokens have mask 0;
- the old log-probs are log softmax(logits / T) at the sampled token, T the sampling temperature, computed
  here with the model's forward pass, and equal to the log-probs the generator drew the tokens with.

The shapes: one EOS id (SmolLM2-like); two EOS ids in the generation config, <|im_end|> and <|endoftext|>
(Qwen2.5-like); <think> and </think> as added tokens (Qwen3-like: single ids, not "special", so
skip_special_tokens keeps them). All use byte_tokenizer's vocabulary, whose filler words (" t300") decode to
text that re-encodes byte by byte: a response rebuilt from its text cannot pass.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import arpo
import loop
import t2po
from common import generation
from common.generation import HFGenerator
from common.models import byte_tokenizer

TEMPERATURE = 0.7  # not 1: old log-probs at the wrong temperature differ from the sampler's
VOCAB = 512  # byte_tokenizer: 256 bytes, 3 specials, filler words " t259" .. " t511"
WORD = 300  # " t300", one id that re-encodes as five (so do " t301", ...)
IM_END, ENDOFTEXT = 257, 256  # byte_tokenizer's <|im_end|> (its eos) and <|endoftext|> (its pad)
THINK = ("<think>", "</think>")

SHAPES = {  # name: (architecture, EOS ids of the generation config, <think> and </think> added)
    "one_eos": ("llama", [IM_END], False),
    "two_eos": ("qwen2", [IM_END, ENDOFTEXT], False),
    "think_tokens": ("qwen3", [IM_END, ENDOFTEXT], True),
}


def build_model(folder: str, arch: str, eos: list[int], think: bool) -> None:
    """A 2-layer model of `arch` with random weights and its byte-level tokenizer, saved as a model folder
    that `--model` loads like any other."""
    from tokenizers import AddedToken
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer(VOCAB)
    if think:  # as Qwen3's tokenizer: added tokens, never split, kept by skip_special_tokens
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    config = AutoConfig.for_model(arch, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                                  bos_token_id=None, eos_token_id=eos[0], pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random weights give near-uniform next-token distributions: make them peaked
        model.model.norm.weight.mul_(5.0)  # (log-probs from about -15 to 0: any token can still be drawn)
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request, tmp_path_factory):
    """(model folder, tokenizer, the model as saved (never trained), its EOS ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch, eos, think = SHAPES[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    build_model(folder, arch, eos, think)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # the drift detector: a filler word's text is five byte tokens, not the word
    assert all(len(tokenizer.encode(tokenizer.decode([w]), add_special_tokens=False)) == 5
               for w in words(16))
    if think:
        assert len(tokenizer.encode("<think>x</think>", add_special_tokens=False)) == 3
    return folder, tokenizer, model, eos


class Draws:
    """A spy on the HF generator, which stays real (model, KV cache, noise, stop strings, EOS ids). It records
    every token a training rollout (temperature > 0) sampled, keyed on the ids before it, with the log-prob
    the generator reported (None for an EOS id: a Sample does not carry its log-prob).

    plan(call, step, rows) -> None, or a token id or None per row of the batch, chooses some draws of the
    step-th token of the call-th training generate call: the uniform of that row's inverse-CDF draw is put
    inside the token's interval, so the model's distribution still draws it and reports its log-prob; only
    the random number is the test's. Events a random model seldom produces become certain (an EOS id, a tool
    call, a filler word), and the assertions hold for whatever the free draws are."""

    def __init__(self, monkeypatch, plan):
        self.sampled: dict[tuple[int, ...], dict[int, float | None]] = {}
        self.prompts: list[list[int]] = []
        self.calls, self.step, self.steering = 0, 0, False
        real_generate, real_draw = HFGenerator.generate, generation.inverse_cdf_sample

        def generate(gen, prompts, **kw):
            self.steering, self.step = kw.get("temperature", 1.0) > 0, 0
            out = real_generate(gen, prompts, **kw)
            if self.steering:
                self.calls += 1
                for prompt, samples in zip(prompts, out, strict=True):
                    self.prompts.append(list(prompt))
                    for s in samples:
                        self.record(prompt, s)
            self.steering = False
            return out

        def draw(probs, uniforms):
            want = plan(self.calls, self.step, probs.shape[0]) if self.steering else None
            self.step += 1
            if want is None:
                return real_draw(probs, uniforms)
            cdf = probs.double().cumsum(-1)
            cdf = cdf / cdf[:, -1:]
            u = uniforms.double().clone()
            for j, tok in enumerate(want):
                if tok is not None:
                    u[j] = ((cdf[j, tok - 1] if tok else 0.0) + cdf[j, tok]) / 2
            tokens = real_draw(probs, u)
            assert all(tok is None or int(t) == tok for t, tok in zip(tokens, want, strict=True))
            return tokens

        monkeypatch.setattr(HFGenerator, "generate", generate)
        monkeypatch.setattr(generation, "inverse_cdf_sample", draw)

    def record(self, prompt: list[int], s) -> None:
        ctx = list(prompt)
        for tok, lp in zip(s.token_ids, s.logprobs, strict=True):
            self.sampled.setdefault(tuple(ctx), {})[tok] = lp
            ctx.append(tok)
        if s.finish_reason == "eos":
            self.sampled.setdefault(tuple(ctx), {})[s.stop_token_id] = None

    def prompt_of(self, ids: list[int]) -> list[int]:
        """The shortest prompt the generator was given that starts `ids`: the row's first prompt."""
        prompt = min((p for p in self.prompts if ids[:len(p)] == p), key=len, default=None)
        assert prompt is not None, "a row that no training prompt starts"
        return prompt


def every(tok: int | None, rows: int) -> list[int | None]:
    return [tok] * rows


def words(rows: int) -> list[int]:
    """A filler word per row, each its own. Rows of one call often hold the same ids so far (a group's first
    prompt, arpo's forced call); from here on their contexts differ, so that a token one row sampled cannot
    pass for a token trained in another (two rows ending the same context with different EOS ids would)."""
    return [WORD + j for j in range(rows)]


def is_word(t: int) -> bool:
    return WORD <= t < WORD + 16


def eos_cycle(eos: list[int]):
    """Ends of turns, row after row: each EOS id in turn, then none (that turn runs on to its token limit)."""
    ends = itertools.cycle([*eos, None])
    return lambda rows: [next(ends) for _ in range(rows)]


def spy_loss(monkeypatch, script) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Patch script.policy_loss to record, per sample of each batch it gets, the sample's ids (its row of the
    distinct sequences, padding removed), its loss mask and the old log-probs the loss divides by."""
    rows, real = [], script.policy_loss

    def policy_loss(logp, batch, args):
        ids, attention = batch["input_ids"][batch["rows"]], batch["attention_mask"][batch["rows"]]
        for i, a, mask, old in zip(ids, attention, batch["action_mask"], batch["old_logp"], strict=True):
            rows.append((i[:int(a.sum())].tolist(), mask, old))
        return real(logp, batch, args)

    monkeypatch.setattr(script, "policy_loss", policy_loss)
    return rows


def check_rows(rows: list[tuple[list[int], torch.Tensor, torch.Tensor]], draws: Draws, model) -> None:
    """rows: what one loss call of the update read, per sequence: its ids (padding removed), the loss mask
    and the old log-probs of its targets (position t scores ids[t + 1]; padded targets included)."""
    assert rows, "the update computed no loss"
    for ids, mask, old in rows:
        n = len(ids)
        assert not mask[n - 1:].any() and mask[:n - 1].any()  # padding never trains; the row does
        prompt = draws.prompt_of(ids)
        assert not mask[:len(prompt) - 1].any()  # the prompt never trains
        with torch.no_grad():  # by hand: the model's logits, / T, log-softmax, at the next token
            logits = model(torch.tensor([ids])).logits[0, :-1].double()  # (n - 1, V)
        hand = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        for t in mask[:n - 1].nonzero()[:, 0].tolist():
            here, tok = draws.sampled.get(tuple(ids[:t + 1]), {}), ids[t + 1]
            assert tok in here, f"token {tok} at {t + 1} trained, but {sorted(here)} sampled after those ids"
            assert float(old[t]) == pytest.approx(float(hand[t]), abs=1e-4)
            if (reported := here[tok]) is not None:  # the log-prob the generator drew it with
                assert reported == pytest.approx(float(hand[t]), abs=1e-4)


def masked_out(ids: list[int], mask: torch.Tensor, start: int) -> list[list[int]]:
    """The runs of mask-0 tokens in ids[start:] (token i's mask is mask[i - 1])."""
    runs, after_trained = [], True
    for i in range(start, len(ids)):
        if not mask[i - 1]:
            if after_trained:
                runs.append([])
            runs[-1].append(ids[i])
        after_trained = bool(mask[i - 1])
    return runs


def trained(ids: list[int], mask: torch.Tensor) -> list[int]:
    return [ids[t + 1] for t in mask[:len(ids) - 1].nonzero()[:, 0].tolist()]


# ---------------------------------------------------------------- loop.py: one sequence per episode


def test_loop_trains_only_sampled_tokens(shape, tmp_path, monkeypatch):
    folder, tok, model, eos = shape
    ends = eos_cycle(eos)
    # each turn: a filler word, then an EOS id (or none: the turn runs on to its token limit)
    draws = Draws(monkeypatch, lambda call, step, rows: words(rows) if step == 0 else ends(rows)
                  if step == 1 else None)
    rows = spy_loss(monkeypatch, loop)
    loop.main(["--env", "toy", "--model", folder, "--backend", "hf", "--lora-rank", "0", "--no-cold-start",
               "--group-size", "2", "--tasks-per-step", "1", "--max-turns", "2", "--max-new-tokens", "6",
               "--temperature", str(TEMPERATURE), "--adv-threshold", "0", "--minibatch-size", "2",
               "--micro-batch-size", "2", "--steps", "1", "--eval-tasks", "1",
               "--out", str(tmp_path / "run")])
    assert len(rows) == 4  # 2 rollouts, 2 epochs: the second epoch after a step still reads pi_old
    check_rows(rows, draws, model)
    for ids, mask, _ in rows:
        context = tok.decode([t for run in masked_out(ids, mask, 1) for t in run])
        assert "Turn 2 of 2: write some words." in context  # the environment's reply is context
        assert sum(map(is_word, trained(ids, mask))) >= 2  # one per turn
    assert {t for ids, mask, _ in rows for t in trained(ids, mask)} >= set(eos)  # each EOS id trained


# ---------------------------------------------------------------- arpo.py: one response, tool results inside

CALL = "<python>print(1)</python>"
RESULT = re.compile(r" <result>\n.*\n</result>", re.DOTALL)  # 48 tokens leave the python call's room


def test_arpo_trains_only_sampled_tokens(shape, tmp_path, monkeypatch):
    folder, tok, model, eos = shape
    call = tok.encode(CALL, add_special_tokens=False)
    ends = eos_cycle(eos)

    def plan(call_no, step, rows):  # the first call writes a python call; then as in loop's test
        if call_no == 0:
            return every(call[step], rows) if step < len(call) else None
        return words(rows) if step == 0 else ends(rows) if step == 1 else None

    draws = Draws(monkeypatch, plan)
    rows, updates = spy_loss(monkeypatch, arpo), []
    real_update = arpo.update

    def update(policy, optimizer, samples, *a, **k):
        out = real_update(policy, optimizer, samples, *a, **k)
        updates.append(samples)  # the step's TrainingSamples: the later minibatch's hold the old log-probs
        return out                # the update computed before its first step

    monkeypatch.setattr(arpo, "update", update)
    # --minibatch-size 2 of 3 responses: two minibatches, the second divides by the old log-probs after a
    # step (1e3f13f: --minibatches 2 became --minibatch-size). --kl-coef: every micro-batch computes its loss
    # even when all rewards tie (a random model's format errors: A = 0).
    arpo.main(["--env", "tools", "--model", folder, "--backend", "hf", "--no-cold-start", "--base-eval",
               "--group-size", "3",
               "--initial-rollouts", "2", "--tasks-per-step", "1", "--max-new-tokens", "48", "--temperature",
               str(TEMPERATURE), "--minibatch-size", "2", "--micro-batch-size", "2", "--kl-coef", "0.01",
               "--lr", "1e-3", "--steps", "1", "--eval-tasks", "1", "--out", str(tmp_path / "run"),
               "--eval-temperature", "0"])  # greedy held-out: the planned draws are the training ones
    check_rows(rows, draws, model)
    [samples] = updates
    # every response as its TrainingSample holds it (mask position t scores token t + 1), with the old
    # log-probs it stored, or for the first minibatch (pi_old: its own forward) those its loss read
    read = {tuple(ids): old for ids, _, old in rows}
    whole = [(s.prompt_ids + s.response_ids,
              torch.tensor(([0] * len(s.prompt_ids) + s.action_mask)[1:]),
              s.old_logp if s.old_logp is not None else read[tuple(s.prompt_ids + s.response_ids)])
             for s in samples]
    assert any(s.old_logp is not None for s in samples)  # the second minibatch's, computed before a step
    check_rows(whole, draws, model)
    assert len(whole) == 3 and {tuple(ids) for ids, _, _ in whole} == set(read)  # each read by the loss
    calls = 0
    for ids, mask, _ in whole:
        prompt = draws.prompt_of(ids)
        results = masked_out(ids, mask, len(prompt))
        assert all(RESULT.fullmatch(tok.decode(run)) for run in results)  # only tool results are left out
        calls += sum(tok.decode(run) == " <result>\n1\n</result>" for run in results)
    assert calls >= 2  # both initial rollouts ran print(1) (a fork shares its parent's call)
    assert {t for ids, mask, _ in whole for t in trained(ids, mask)} >= set(eos)  # each EOS id trained


# ---------------------------------------------------------------- t2po.py: one sample per turn, forced tokens


def test_t2po_trains_only_sampled_tokens(shape, tmp_path, monkeypatch):
    folder, tok, model, _ = shape
    # two thinking words (TTI's cap is 2: it forces `</think>\n<action>` in every turn), then free sampling
    draws = Draws(monkeypatch, lambda call, step, rows: words(rows) if step < 2 else None)
    rows = spy_loss(monkeypatch, t2po)
    # --minibatch-size 2 of 4 turns: the second mini-batch divides by the old log-probs after a step.
    # --kl-coef: every micro-batch computes its loss even when all advantages are 0 (1e3f13f: t2po now skips
    # such a micro-batch, as arpo did), so that every turn is read.
    t2po.main(["--env", "toy", "--model", folder, "--backend", "hf", "--no-cold-start", "--group-size", "2",
               "--tasks-per-step", "1", "--max-turns", "2", "--max-new-tokens", "24", "--temperature",
               str(TEMPERATURE), "--tti-max-think", "2", "--tti-chunk", "4", "--minibatch-size", "2",
               "--micro-batch-size", "2", "--kl-coef", "0.01", "--lr", "1e-3", "--reward", "env", "--steps", "1",
               "--eval-tasks", "1", "--out", str(tmp_path / "run")])
    assert len(rows) == 4  # 2 episodes x 2 turns
    check_rows(rows, draws, model)
    for ids, mask, _ in rows:
        prompt = draws.prompt_of(ids)
        forced = masked_out(ids, mask, len(prompt))
        assert [tok.decode(run) for run in forced] == [t2po.FORCED_TEXT]  # TTI's tokens, never trained
        assert all(map(is_word, trained(ids, mask)[:2]))
