import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.logprobs import token_logprobs
from common.models import TINY_MODEL, load_policy

# two sequences of different lengths, the shorter one left-padded as a batch is built for RL
SEQS = [[1, 504, 3458, 28, 1028, 2, 9023, 314, 7, 11], [1, 2053, 88, 1500, 2]]


def padded_batch(pad_id: int):
    T = max(map(len, SEQS))
    ids = torch.tensor([[pad_id] * (T - len(s)) + s for s in SEQS])  # (2, 10)
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in SEQS])  # (2, 10)
    return ids, mask


def reference(model, seq: list[int], temperature: float):
    """Unchunked: each sequence alone, no padding, full (T, V) logits -> log_softmax -> gather."""
    ids = torch.tensor([seq])
    logits = model(input_ids=ids).logits[0, :-1] / temperature  # (T-1, V)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[0, 1:, None]).squeeze(-1)  # (T-1,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_policy(TINY_MODEL)


@pytest.mark.parametrize("lora, dtype, chunk_size", [
    (False, "float32", 3), (True, "float32", 3), (False, "float64", 3), (True, "float64", 3),
    (False, "float64", 64),  # one chunk: the path without recompute
])
def test_chunked_equals_unchunked_values_and_gradients(lora, dtype, chunk_size):
    torch.manual_seed(0)
    model, tok = load_policy(TINY_MODEL, lora_rank=4 if lora else 0, dtype=dtype)
    if lora:  # make the adapter non-zero so its gradient path is exercised
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = padded_batch(tok.pad_token_id)
    temperature = 0.7
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    weights = weights.to(getattr(torch, dtype))

    # chunk_size 3 does not divide the 13 valid targets: a ragged last chunk
    logp, entropy = token_logprobs(model, ids, mask, temperature=temperature, chunk_size=chunk_size,
                                   with_entropy=True)
    assert logp.shape == entropy.shape == (2, 9) and logp.dtype == getattr(torch, dtype)
    grads = torch.autograd.grad((logp * weights).sum() + entropy.sum(), params)

    ref_loss = 0.0
    for b, seq in enumerate(SEQS):
        ref_logp, ref_ent = reference(model, seq, temperature)
        n = len(seq) - 1
        assert torch.allclose(logp[b, -n:], ref_logp, atol=1e-5)
        assert torch.allclose(entropy[b, -n:], ref_ent, atol=1e-5)
        assert torch.all(logp[b, :-n] == 0) and torch.all(entropy[b, :-n] == 0)  # padding targets
        ref_loss = ref_loss + (ref_logp * weights[b, -n:]).sum() + ref_ent.sum()
    ref_grads = torch.autograd.grad(ref_loss, params)
    # fp32 summation order differs between the two paths (errors ~1e-5 of the gradient's scale); in fp64
    # the two must agree to rounding, which a wrong term (a missed chunk, temperature) would not
    tol = 3e-5 if dtype == "float32" else 1e-10
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= tol * r.abs().max().clamp(min=1.0)


def test_lora_with_gradient_checkpointing_matches_plain():
    ids, mask = padded_batch(2)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)  # same LoRA init both times
        model, _ = load_policy(TINY_MODEL, lora_rank=2, gradient_checkpointing=ckpt)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.05)
        token_logprobs(model, ids, mask, chunk_size=4).sum().backward()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_values_by_hand_on_last_position(tiny):
    model, _ = tiny
    ids, mask = torch.tensor([[1, 504, 3458]]), torch.ones(1, 3, dtype=torch.long)
    with torch.no_grad():
        out = token_logprobs(model, ids, mask, chunk_size=1)
        logits = model(input_ids=ids).logits[0, 1]  # predicts ids[0, 2]
    by_hand = logits[3458] - torch.log(torch.exp(logits.double()).sum()).float()
    assert torch.allclose(out[0, 1], by_hand, atol=1e-5)


def test_no_grad_and_chunk_size_do_not_change_values(tiny):
    model, tok = tiny
    ids, mask = padded_batch(tok.pad_token_id)
    with torch.no_grad():
        a = token_logprobs(model, ids, mask, chunk_size=1)
        b = token_logprobs(model, ids, mask, chunk_size=10_000)
    assert not a.requires_grad
    assert torch.allclose(a, b, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op (forward or backward) creates while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_vocabulary_sized_tensor_beyond_one_chunk():
    # Forward + backward with entropy: no op may create a tensor larger than one chunk's (chunk, V)
    # logits; the control with one chunk covering the sequence shows the probe sees a (T-1, V) tensor.
    from transformers import LlamaConfig, LlamaForCausalLM

    V, T, chunk = 16_000, 256, 8
    cfg = LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, V, (1, T))
    mask = torch.ones_like(ids)
    largest = []
    for chunk_size in (chunk, T):
        with LargestTensor() as probe:
            logp, entropy = token_logprobs(model, ids, mask, chunk_size=chunk_size, with_entropy=True)
            (logp.sum() + entropy.sum()).backward()
        largest.append(probe.numel)
    assert largest[0] == chunk * V  # the chunk's logits (and their log-softmax, grads) are the largest
    assert largest[1] == (T - 1) * V


def test_target_mask_computes_only_kept_targets_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    model, tok = load_policy(TINY_MODEL, dtype="float64")
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = padded_batch(tok.pad_token_id)  # (2, 10); row 1 has 5 left-pad tokens
    keep = torch.zeros(2, 9, dtype=torch.bool)
    keep[0, [2, 3, 8]] = True  # three targets of row 0
    keep[1, [0, 7]] = True  # a padding target (stays 0: no context) and one real target
    full = token_logprobs(model, ids, mask)
    part = token_logprobs(model, ids, mask, target_mask=keep, chunk_size=2)  # 3 real targets: 2 chunks
    kept = keep & mask[:, 1:].bool() & mask[:, :-1].bool()
    assert int(kept.sum()) == 4
    assert torch.allclose(part[kept], full[kept], atol=1e-10)
    assert torch.all(part[~kept] == 0)
    # gradient of a sum over the kept targets is the same either way; a dropped target adds nothing
    g_part = torch.autograd.grad(part.sum(), params)
    g_full = torch.autograd.grad((full * kept).sum(), params)
    for a, b in zip(g_part, g_full, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_target_mask_skips_the_vocabulary_projection_of_dropped_targets():
    # lm_head sees only the kept rows: (number kept, H), not (all targets, H)
    torch.manual_seed(0)
    model, tok = load_policy(TINY_MODEL)
    ids, mask = padded_batch(tok.pad_token_id)
    keep = torch.zeros(2, 9, dtype=torch.bool)
    keep[0, 4:7] = True
    rows = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[:-1].numel()))
    with torch.no_grad():
        token_logprobs(model, ids, mask, target_mask=keep, chunk_size=512)
    hook.remove()
    # the model's own forward (logits of each row's last position: 2), then our 3 kept targets (not 13)
    assert rows == [2, 3]


def test_autocast_auto_trains_in_bf16_only_where_the_hardware_has_it(monkeypatch):
    from types import SimpleNamespace

    from common import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native, expected in ((False, False), (True, True)):
        monkeypatch.setattr(run, "native_bf16", lambda native=native: ("avx512_bf16",) if native else ())
        assert run.bf16_training(SimpleNamespace(autocast="auto")) is expected
        assert run.bf16_training(SimpleNamespace(autocast="bf16")) is True  # asked for: even emulated
        assert run.bf16_training(SimpleNamespace(autocast="off")) is False


def test_bf16_autocast_moves_log_probs_a_little_and_keeps_fp32_weights_and_gradients():
    from types import SimpleNamespace

    from common import run

    model, tokenizer = load_policy(TINY_MODEL)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)  # a peaked distribution, as a trained model's
    ids = torch.randint(5, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))  # (B, T)
    mask = torch.ones_like(ids)
    fp32 = token_logprobs(model, ids, mask)  # (B, T-1)
    fp32.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with run.precision(SimpleNamespace(autocast="bf16")):
        bf16 = token_logprobs(model, ids, mask)
    bf16.sum().backward()
    assert bf16.dtype == torch.float32
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    diff = (bf16 - fp32).abs()
    assert 0 < diff.mean() < 0.1  # bf16 matmuls ran (8 mantissa bits), and stayed close
    err = torch.stack([(p.grad - g).norm() for p, g in zip(model.parameters(), grads, strict=True)]).norm()
    assert err / torch.stack([g.norm() for g in grads]).norm() < 0.1


def test_bf16_forward_after_an_optimizer_step_sees_the_new_weights():
    """The update and the cold start run inside one autocast context across optimizer steps: a forward
    after a step must use the stepped weights (autocast's default cast cache would keep the old bf16 copy)."""
    from types import SimpleNamespace

    from common import run

    model, tokenizer = load_policy(TINY_MODEL)
    ids = torch.randint(5, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(1))  # (1, T)
    mask = torch.ones_like(ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with run.precision(SimpleNamespace(autocast="bf16")):
        before = token_logprobs(model, ids, mask)
        before.sum().backward()
        optimizer.step()
        after = token_logprobs(model, ids, mask).detach()
    with run.precision(SimpleNamespace(autocast="bf16")):
        fresh = token_logprobs(model, ids, mask).detach()
    assert not torch.allclose(after, before.detach(), atol=1e-3)
    torch.testing.assert_close(after, fresh, atol=0, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_shared_prefix_packing_is_exact_under_sdpa_and_eager_attention(implementation):
    """Packed rows of a prefix forest equal the rows alone under both attention implementations that
    read a 4D mask: eager adds the mask to the scores, so a boolean mask (0/1, f311b87: 0.067 off on
    this model) would not mask; the forest passes an additive one."""
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, dtype="float64")
    model.config._attn_implementation = implementation
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 0], [5, 6, 7, 11, 12, 13, 14], [5, 6, 20, 21, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    alone = torch.cat([token_logprobs(model, ids[b:b + 1, :int(mask[b].sum())],
                                      mask[b:b + 1, :int(mask[b].sum())]).flatten() for b in range(3)])
    packed = token_logprobs(model, ids, mask, share_prefixes=True)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    # HF's eager attention takes its softmax in float32 whatever the model's dtype, and a float32 sum
    # over 7 columns (4 masked) may round unlike one over 3 on another CPU's vector width: 1e-8 seen
    atol = 1e-12 if implementation == "sdpa" else 1e-6
    torch.testing.assert_close(packed[valid], alone, atol=atol, rtol=0)


def test_shared_prefix_packing_refuses_an_attention_that_reads_no_4d_mask():
    model, _ = load_policy(TINY_MODEL)
    model.config._attn_implementation = "flash_attention_2"
    ids, mask = torch.tensor([[5, 6, 7], [5, 6, 8]]), torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="--no-share-prefixes"):
        token_logprobs(model, ids, mask, share_prefixes=True)
