"""Token log-probs (and entropies) of a batch under the training model, computed in chunks.

The vocabulary projection is the memory hog of RL training: (B, T, V) logits for a 150k vocabulary and 8k
tokens are 4.8 GB in fp32, and log_softmax plus its backward need several such tensors. Here the model runs
up to its final hidden states (B, T, H); lm_head + log-softmax then run on `chunk_size` tokens at a time
under activation checkpointing, so forward and backward each hold at most (chunk_size, V) logits.
"""

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common.models import unwrap


def _decoder(model: nn.Module) -> nn.Module:
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # peft: LoRA layers live inside the base model's modules
        inner = inner.get_base_model()
    return inner.get_decoder()


def final_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, T) -> (B, T, H) hidden states after the final norm, i.e. what lm_head sees.

    The call goes through `model` itself (so DDP / peft wrappers see a normal forward) with logits for
    only the last position; a hook on the decoder grabs its output.
    """
    captured = []

    def grab(module, args, out):
        captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    hook = _decoder(model).register_forward_hook(grab)
    # positions count real tokens only, as HF generate does for left-padded prompts
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return captured[-1]


def _chunk_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float,
                    with_entropy: bool) -> tuple[Tensor, Tensor]:
    logits = head(hidden)  # (N, V)
    if logits.dtype in (torch.bfloat16, torch.float16):  # softmax over a big vocabulary wants fp32
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)  # (N, V): fused kernel, faster on CPU than gather - logsumexp
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    if not with_entropy:
        return logp, logp.new_zeros(())
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # H = -sum_v p_v log p_v
    return logp, entropy


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
    with_entropy: bool = False,
    target_mask: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """(B, T) ids -> (B, T-1) log-probs, out[:, t] = log p(ids[:, t+1] | ids[:, :t+1]) under
    softmax(logits / temperature); with_entropy also returns the entropy of that distribution, (B, T-1).
    float32 (bf16/fp16 logits are upcast before the softmax), float64 for a float64 model.

    Differentiable. Positions where attention_mask[:, t] or attention_mask[:, t+1] is 0 (padding, and the
    first real token of a left-padded row) are 0 and cost nothing.
    `chunk_size` counts tokens of the whole batch, so at most (chunk_size, V) logits exist at once.
    `target_mask` (B, T-1) bool, optional: compute only the targets it keeps (e.g. an RL agent's action
    tokens, with the environment's long observations left out); the others are 0 and cost no vocabulary
    projection. The values it keeps are the same as without it.
    """
    hidden = final_hidden_states(model, input_ids, attention_mask)[:, :-1]  # (B, T-1, H)
    # a target counts when it and the token before it are real: the first real token has no context
    valid = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()  # (B, T-1)
    if target_mask is not None:
        valid = valid & target_mask.bool()
    hidden, targets = hidden[valid], input_ids[:, 1:][valid]  # (N, H), (N,)
    head = unwrap(model).get_output_embeddings()
    logps, entropies = [], []
    # checkpoint: backward recomputes each chunk's logits instead of keeping all chunks' alive. A single
    # chunk is already within the bound, so it skips the recompute (one lm_head matmul fewer).
    recompute = torch.is_grad_enabled() and targets.shape[0] > chunk_size
    for start in range(0, targets.shape[0], chunk_size):
        chunk = (head, hidden[start:start + chunk_size], targets[start:start + chunk_size], temperature,
                 with_entropy)
        logp, entropy = checkpoint(_chunk_logprobs, *chunk, use_reentrant=False) if recompute \
            else _chunk_logprobs(*chunk)
        logps.append(logp)
        entropies.append(entropy)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = hidden.new_zeros(valid.shape, dtype=dtype)  # (B, T-1)
    out = out.masked_scatter(valid, torch.cat(logps)) if logps else out
    if not with_entropy:
        return out
    ent = torch.zeros_like(out)
    ent = ent.masked_scatter(valid, torch.cat(entropies)) if entropies else ent
    return out, ent
