"""Token log-probs (and entropies) of a batch under the training model, computed in chunks.

The vocabulary projection is the memory hog of RL training: (B, T, V) logits for a 150k vocabulary and 8k
tokens are 4.8 GB in fp32, and log_softmax plus its backward need several such tensors. Here the model runs
up to its final hidden states (B, T, H); lm_head + log-softmax then run on `chunk_size` tokens at a time
under activation checkpointing, so forward and backward each hold at most (chunk_size, V) logits.

With `share_prefixes`, rows that start with the same tokens (a group's prompt, the system prompt of every
turn) are packed into a prefix tree and each distinct prefix runs once: one packed row holds several
trees, every token attends to its own ancestors only, and its position is its depth. A token's hidden
state depends only on the tokens before it, so every row's log-probs, and the gradient that flows back
through the shared tokens (the sum over the rows that share them), equal the unpacked ones up to float
rounding. Attention runs per segment (the tokens one row added to the forest), over that segment's
ancestors and itself: a dense N x N mask would compute 4-10x the pairs a forest needs.
"""

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from common.models import unwrap


def _decoder(model: nn.Module) -> nn.Module:
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # peft: LoRA layers live inside the base model's modules
        inner = inner.get_base_model()
    return inner.get_decoder()


@dataclass
class Segment:
    """Nodes [start, end) of a packed row that one row added to the forest: a chain, so each of them
    attends to its keys (its ancestors before `start`, then the chain itself) under `mask`."""
    start: int
    end: int
    spans: tuple[tuple[int, int], ...]  # the keys as [a, b) ranges: ancestors (root first), chain
    mask: Tensor | None  # (end - start, K) bool; None: no ancestors, plain causal attention

    @property
    def keys(self) -> Tensor:
        """(K,) the keys' node indices in the row (on the CPU)."""
        return torch.tensor([i for a, b in self.spans for i in range(a, b)])


def forest_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     forest_segments: list[list[Segment]] | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's SDPA attention, and with `forest_segments` (R, heads, N, d) queries of packed rows that
    attend segment by segment."""
    if forest_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: a KV head serves `groups`
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # (R, heads, N, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for r, segments in enumerate(forest_segments):
        parts = []
        for seg in segments:
            q = query[r:r + 1, :, seg.start:seg.end]  # (1, heads, L, d)
            if seg.mask is None:
                k, v = key[r:r + 1, :, seg.start:seg.end], value[r:r + 1, :, seg.start:seg.end]
                parts.append(sdpa(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True))
            else:
                # the keys gathered as slices, not by index: an index's backward (index_put with
                # accumulation) cost 4% of the update
                k = torch.cat([key[r:r + 1, :, a:b] for a, b in seg.spans], dim=2)  # (1, heads, K, d)
                v = torch.cat([value[r:r + 1, :, a:b] for a, b in seg.spans], dim=2)
                parts.append(sdpa(q, k, v, attn_mask=seg.mask, dropout_p=dropout, scale=scaling))
        end = segments[-1].end if segments else 0
        parts.append(value[r:r + 1, :, end:])  # padding nodes attend to themselves alone
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None  # (R, N, heads, d) as SDPA's


# SDPA models attend per segment when a forward is given `forest_segments`, and as before otherwise.
# Dispatch on the argument, not a config switch: a checkpointed layer's recompute in backward must
# take the same path as its forward.
AttentionInterface.register("sdpa", forest_attention)


def final_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                        position_ids: Tensor | None = None,
                        segments: list[list[Segment]] | None = None) -> Tensor:
    """(B, T) -> (B, T, H) hidden states after the final norm, i.e. what lm_head sees.

    The call goes through `model` itself (so DDP / peft wrappers see a normal forward) with logits for
    only the last position; a hook on the decoder grabs its output. attention_mask: (B, T) padding mask,
    or a (B, 1, T, T) boolean mask of what each token attends to, with explicit `position_ids`;
    `segments` (a prefix forest's): an SDPA model attends per segment instead of over that mask; an
    eager one reads the mask, made additive here (eager adds a mask to the scores: a boolean one
    would add 0/1, not 0/-inf). Another implementation is refused: flash kernels do not read a 4D
    mask, so packed rows would attend across trees.
    """
    captured = []

    def grab(module, args, out):
        captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    hook = _decoder(model).register_forward_hook(grab)
    if position_ids is None:  # positions count real tokens only, as HF generate does for left padding
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    extra = {"forest_segments": segments} if segments is not None else {}  # to forest_attention
    if attention_mask.dim() == 4:
        attention_mask = additive_mask(model, attention_mask)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              use_cache=False, logits_to_keep=1, **extra)
    finally:
        hook.remove()
    return captured[-1]


def additive_mask(model: nn.Module, attend: Tensor) -> Tensor:
    """A (R, 1, N, N) boolean mask of what each node attends to as the scores' additive mask (0 where
    it attends, the dtype's minimum where not), which SDPA and eager attention both read right."""
    implementation = getattr(unwrap(model).config, "_attn_implementation", "sdpa")
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"shared-prefix packing needs sdpa or eager attention, not "
                         f"{implementation!r}: pass --no-share-prefixes")
    dtype = next(unwrap(model).parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(
        ~attend, torch.finfo(dtype).min)


@dataclass
class PrefixForest:
    """The rows of a (B, T) batch as a forest of prefixes, packed into R rows of N nodes: one node per
    distinct prefix, so a token shared by several rows' prefixes appears once."""
    input_ids: Tensor  # (R, N) each node's token; padding nodes hold token 0
    position_ids: Tensor  # (R, N) each node's depth: the position its token has in every row holding it
    attend: Tensor  # (R, 1, N, N) bool: node i attends to node k, k = i or an ancestor of i
    node_of: Tensor  # (B, T) the flat index r * N + i of the node of ids[b, t]; -1 for padding
    segments: list[list[Segment]]  # per packed row, its real nodes in order as chains


def prefix_forest(input_ids: Tensor, attention_mask: Tensor, max_row_tokens: int = 1024) -> PrefixForest:
    """Pack the real tokens of each row (attention_mask 1) into prefix trees, whole trees to a row, up to
    `max_row_tokens` nodes a row (a larger tree gets a row of its own): attention costs N² a row."""
    ids, keep = input_ids.tolist(), attention_mask.bool().tolist()
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; parent -1: a tree's root
    parent, token, depth, tree = [], [], [], []
    node_of = [[-1] * len(row) for row in ids]
    chains = []  # (first, end) node ids each row added: consecutive, a chain under parent[first]
    for b, row in enumerate(ids):
        node, first = -1, len(token)
        for t, tok in enumerate(row):
            if not keep[b][t]:
                continue
            if (node, tok) not in child:
                child[node, tok] = len(token)
                parent.append(node)
                token.append(tok)
                depth.append(depth[node] + 1 if node >= 0 else 0)
                tree.append(tree[node] if node >= 0 else len(token) - 1)
            node = node_of[b][t] = child[node, tok]
        if len(token) > first:
            chains.append((first, len(token)))
    sizes: dict[int, int] = defaultdict(int)
    for root in tree:
        sizes[root] += 1
    row_of_tree, row, used = {}, -1, max_row_tokens  # greedy: trees in order, a new row when one is full
    for root, size in sizes.items():
        if used + size > max_row_tokens:
            row, used = row + 1, 0
        row_of_tree[root], used = row, used + size
    rows = max(row + 1, 1)
    members = [[n for n in range(len(token)) if row_of_tree[tree[n]] == r] for r in range(rows)]
    width = max(1, *map(len, members))
    cpu = torch.device("cpu")  # built here whatever the default device, then moved to the batch's
    packed_ids = torch.zeros(rows, width, dtype=torch.long, device=cpu)
    positions = torch.zeros(rows, width, dtype=torch.long, device=cpu)
    attend = torch.eye(width, dtype=torch.bool, device=cpu).repeat(rows, 1, 1)  # padding: itself
    flat = [0] * len(token)  # node -> r * width + i
    for r, nodes in enumerate(members):
        for i, n in enumerate(nodes):  # creation order: a parent comes before its children
            flat[n] = r * width + i
            packed_ids[r, i], positions[r, i] = token[n], depth[n]
            if parent[n] >= 0:
                attend[r, i] |= attend[r, flat[parent[n]] - r * width]
    node_index = torch.tensor([[flat[n] if n >= 0 else -1 for n in row] for row in node_of],
                              dtype=torch.long, device=cpu).reshape(input_ids.shape)
    device = input_ids.device
    return PrefixForest(packed_ids.to(device), positions.to(device), attend[:, None].to(device),
                        node_index.to(device), _segments(chains, parent, flat, width, rows, device))


def _segments(chains: list[tuple[int, int]], parent: list[int], flat: list[int], width: int,
              rows: int, device) -> list[list[Segment]]:
    """Each chain as a Segment of its packed row: its ancestors are spans of earlier chains."""
    chain_of = {}
    for c, (first, end) in enumerate(chains):
        chain_of.update(dict.fromkeys(range(first, end), c))
    out = [[] for _ in range(rows)]
    for first, end in chains:
        r, start = divmod(flat[first], width)
        spans, p = [], parent[first]
        while p >= 0:  # up the tree: the part of p's chain up to p, then that chain's parent
            top = chains[chain_of[p]][0]
            spans.append(range(flat[top] - r * width, flat[p] - r * width + 1))
            p = parent[top]
        length = end - first
        ranges = [(span.start, span.stop) for span in reversed(spans)] + [(start, start + length)]
        if not spans:
            out[r].append(Segment(start, start + length, tuple(ranges), None))
            continue
        ancestors = sum(len(span) for span in spans)
        mask = torch.ones(length, ancestors + length, dtype=torch.bool)
        mask[:, ancestors:] = torch.ones(length, length, dtype=torch.bool).tril()
        out[r].append(Segment(start, start + length, _joined(ranges), mask.to(device)))
    return out


def _joined(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Consecutive [a, b) ranges with each one that starts where the one before ends merged into it."""
    out = [ranges[0]]
    for a, b in ranges[1:]:
        if a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


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
    share_prefixes: bool = False,
    max_row_tokens: int = 1024,
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
    `share_prefixes`: each distinct prefix of the rows runs once (`prefix_forest`, packed rows of at most
    `max_row_tokens` nodes), and each distinct (prefix, next token) pair's log-prob once; the same values
    and gradients up to float rounding.
    """
    # a target counts when it and the token before it are real: the first real token has no context
    valid = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()  # (B, T-1)
    if target_mask is not None:
        valid = valid & target_mask.bool()
    targets = input_ids[:, 1:][valid]  # (N,)
    if share_prefixes:
        forest = prefix_forest(input_ids, attention_mask, max_row_tokens)
        states = final_hidden_states(model, forest.input_ids, forest.attend, forest.position_ids,
                                     forest.segments)
        nodes = forest.node_of[:, :-1][valid]  # (N,) the node whose state predicts each target
        # rows that share a prefix and its next token share the target too: score each pair once
        pairs, copy = torch.unique(nodes * (int(targets.max()) + 1 if len(targets) else 1) + targets,
                                   return_inverse=True)
        first = torch.zeros_like(pairs).scatter_(0, copy, torch.arange(len(copy), device=copy.device))
        hidden = states.flatten(0, 1)[nodes[first]]  # (P, H)
        targets = targets[first]
    else:
        hidden = final_hidden_states(model, input_ids, attention_mask)[:, :-1][valid]  # (N, H)
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
    if share_prefixes and logps:  # each target's value: its pair's
        logps, entropies = [torch.cat(logps)[copy]], [torch.cat(entropies)[copy]] if with_entropy else []
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    out = hidden.new_zeros(valid.shape, dtype=dtype)  # (B, T-1)
    out = out.masked_scatter(valid, torch.cat(logps)) if logps else out
    if not with_entropy:
        return out
    ent = torch.zeros_like(out)
    ent = ent.masked_scatter(valid, torch.cat(entropies)) if entropies else ent
    return out, ent
