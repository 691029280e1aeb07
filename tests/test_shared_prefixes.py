"""Shared-prefix packing (common.logprobs.prefix_forest, token_logprobs(share_prefixes=True)): the tree is
the one drawn by hand, and every row's log-probs, entropies and gradients equal the row's own forward."""
import pytest
import torch

from common.logprobs import prefix_forest, token_logprobs
from common.models import TINY_MODEL, load_policy

# A tree of depth 3, drawn by hand (letters: tokens; rows read root to leaf):
#   P=[5 6 7] -> A=[8 9] -> [10 11] | [12]       rows 0, 1
#             -> [13]   -> [14] (twice: a repeated row)                rows 2, 3
#   [5 6] -> [15]                                                       row 4: leaves P after 2 tokens
#   [20 21]                                                             row 5: a tree of its own
ROWS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 12], [5, 6, 7, 13, 14], [5, 6, 7, 13, 14],
        [5, 6, 15], [20, 21]]
DISTINCT = 13  # 5 6 7 8 9 10 11 12 13 14 15, then 20 21: the tokens of the forest, counted by hand


def batch(rows, left=False):
    width = max(map(len, rows))

    def pad(r, v):
        return [v] * (width - len(r)) + r if left else r + [v] * (width - len(r))

    return (torch.tensor([pad(r, 0) for r in rows]),  # (B, T)
            torch.tensor([pad([1] * len(r), 0) for r in rows]))  # (B, T)


def test_the_forest_is_the_tree_drawn_by_hand():
    ids, mask = batch(ROWS)
    f = prefix_forest(ids, mask, max_row_tokens=64)
    assert f.input_ids.shape == (1, DISTINCT)
    nodes = f.input_ids[0].tolist()
    assert nodes == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 20, 21]  # creation order: parents first
    assert f.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 3, 4, 2, 0, 1]  # depth = position
    # node 11 (index 6) sees 5 6 7 8 9 10 11; node 15 (index 10) sees 5 6 15; 21 sees 20 21 only
    attend = f.attend[0, 0]
    assert attend[6].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert attend[7].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 7]
    assert attend[10].nonzero().flatten().tolist() == [0, 1, 10]
    assert attend[12].nonzero().flatten().tolist() == [11, 12]
    assert f.node_of[2].tolist() == f.node_of[3].tolist() == [0, 1, 2, 8, 9, -1, -1]  # repeated
    assert f.node_of[5].tolist()[:2] == [11, 12] and f.node_of[5].tolist()[2:] == [-1] * 5


def test_rows_hold_whole_trees_within_the_budget():
    ids, mask = batch(ROWS)
    f = prefix_forest(ids, mask, max_row_tokens=11)  # the big tree (11 nodes) fills a row; 20 21 next
    assert f.input_ids.shape == (2, 11)
    assert f.input_ids[1, :2].tolist() == [20, 21] and f.position_ids[1, :2].tolist() == [0, 1]
    assert f.node_of[5, :2].tolist() == [11, 12]  # flat index: row 1, nodes 0 and 1
    assert not f.attend[1, 0, 1, 0:1].logical_not().any()  # 21 sees 20
    small = prefix_forest(ids, mask, max_row_tokens=4)  # a tree larger than the budget: a row of its own
    assert small.input_ids.shape == (2, 11)


def rows_alone(model, rows, temperature, weights):
    """Each row by itself: no padding, no packing; the loss Σ weights · log p and the values."""
    loss, values, entropies = 0.0, [], []
    for b, row in enumerate(rows):
        ids = torch.tensor([row])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature  # (T-1, V)
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, ids[0, 1:, None]).squeeze(-1)
        values.append(logp)
        entropies.append(-(logp_all.exp() * logp_all).sum(-1))
        loss = loss + (logp * weights[b][:len(row) - 1]).sum()
    return loss, values, entropies


@pytest.mark.parametrize("left, budget, lora", [(False, 64, False), (True, 64, False), (False, 5, True)])
def test_packed_log_probs_and_gradients_equal_each_row_alone(left, budget, lora):
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL, lora_rank=4 if lora else 0)
    model.eval()  # no dropout: both sides see the same function
    if lora:  # a non-zero adapter, so its gradient path is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = batch(ROWS, left)
    width = ids.shape[1]
    weights = torch.randn(len(ROWS), width - 1, generator=torch.Generator().manual_seed(2))
    loss, values, entropies = rows_alone(model, ROWS, 0.7, weights)
    expected = torch.autograd.grad(loss, params)
    logp, entropy = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=True,
                                   share_prefixes=True, max_row_tokens=budget, chunk_size=4)

    def aligned(w, r):  # a row's targets
        return w[:, :len(r) - 1] if not left else w[:, width - len(r):]

    packed_loss = sum((aligned(logp[b:b + 1], r) * weights[b:b + 1, :len(r) - 1]).sum()
                      for b, r in enumerate(ROWS))
    got = torch.autograd.grad(packed_loss, params)
    for b, row in enumerate(ROWS):
        torch.testing.assert_close(aligned(logp[b:b + 1], row)[0], values[b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(aligned(entropy[b:b + 1], row)[0], entropies[b], rtol=1e-5, atol=1e-5)
    # Each element within 5e-5 of its tensor's scale (fp32 sums in another order: ~1e-6 of it, up
    # to 1.03e-5 seen on one CPU), the whole gradient within 1e-5 relative; a wrong mask: order 1.
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=5e-5 * float(e.abs().max()) + 1e-12)
    relative = torch.cat([(g - e).flatten() for g, e in zip(got, expected, strict=True)]).norm() / torch.cat(
        [e.flatten() for e in expected]).norm()
    assert relative < 1e-5


def test_target_mask_and_padding_give_zeros_and_the_same_kept_values():
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL)
    ids, mask = batch(ROWS)
    keep = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    keep[:, 3:] = True  # the responses, say
    with torch.no_grad():
        plain = token_logprobs(model, ids, mask, target_mask=keep)
        packed = token_logprobs(model, ids, mask, target_mask=keep, share_prefixes=True)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert (packed[~keep] == 0).all() and (packed[5] == 0).all()  # row 5 has no target past 3
    none = token_logprobs(model, ids, mask, target_mask=torch.zeros_like(keep), share_prefixes=True)
    assert none.shape == keep.shape and (none == 0).all()


def test_segments_are_the_chains_drawn_by_hand():
    """Each row's new tokens form one segment; its keys are its ancestors (root first), then itself."""
    ids, mask = batch(ROWS)
    f = prefix_forest(ids, mask, max_row_tokens=64)
    got = [(s.start, s.end, s.keys.tolist() if s.mask is not None else None) for s in f.segments[0]]
    assert got == [(0, 7, None),  # row 0: 5 6 7 8 9 10 11, the root chain: plain causal
                   (7, 8, [0, 1, 2, 3, 4, 7]),  # row 1: 12 under 9
                   (8, 10, [0, 1, 2, 8, 9]),  # row 2: 13 14 under 7 (row 3 adds nothing)
                   (10, 11, [0, 1, 10]),  # row 4: 15 under 6
                   (11, 13, None)]  # row 5: 20 21, a tree of its own
    # the same keys as ranges of the row, which forest_attention slices
    assert [s.spans for s in f.segments[0] if s.mask is not None] == [
        ((0, 5), (7, 8)), ((0, 3), (8, 10)), ((0, 2), (10, 11))]
    two = f.segments[0][2]
    assert two.mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    for seg in f.segments[0]:  # the same pairs as the forest's attend mask
        for i in range(seg.start, seg.end):
            seen = seg.keys[seg.mask[i - seg.start]] if seg.mask is not None \
                else torch.arange(seg.start, i + 1)
            assert seen.tolist() == f.attend[0, 0, i].nonzero().flatten().tolist()


def test_packed_attention_runs_per_segment(monkeypatch):
    """The packed forward computes each segment's pairs, never the forest's full N x N."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model, _ = load_policy(TINY_MODEL)
    ids, mask = batch(ROWS)
    with torch.no_grad():
        token_logprobs(model, ids, mask, share_prefixes=True)
    layers = model.config.num_hidden_layers
    assert sorted(set(calls)) == [(1, 3), (1, 6), (2, 2), (2, 5), (7, 7)]
    assert len(calls) == 5 * layers
    calls.clear()
    with torch.no_grad():
        token_logprobs(model, ids, mask)  # unpacked: the padded batch's own attention
    assert set(calls) == {(7, 7)}


def test_checkpointed_layers_recompute_per_segment_with_the_same_gradients(monkeypatch):
    """Under gradient checkpointing the backward re-runs each layer: it must take the per-segment
    path again (a different path saves other tensors, and torch refuses), with equal gradients."""
    ids, mask = batch(ROWS)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, _ = load_policy(TINY_MODEL, gradient_checkpointing=checkpointing)
        model.train()  # HF checkpoints a layer only in train mode
        logp = token_logprobs(model, ids, mask, share_prefixes=True)
        grads.append(torch.autograd.grad(logp.sum(), list(model.parameters())))
    for g, e in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_a_chain_right_after_its_parent_is_one_span():
    """[1 2 3 4] continues [1 2 3] at its last node, and its chain is the next node of the row: its
    keys 0 1 2 3 are one range, not the ancestors' range and its own."""
    ids, mask = batch([[1, 2, 3], [1, 2, 3, 4]])
    seg = prefix_forest(ids, mask).segments[0][1]
    assert (seg.start, seg.keys.tolist(), seg.spans) == (3, [0, 1, 2, 3], ((0, 4),))


def test_a_chain_under_a_branch_sees_two_spans_and_the_right_values():
    """[5 6 7 13 16] leaves row 2's chain (13 14) after 13: its keys are two spans, 5 6 7 and 13."""
    rows = ROWS + [[5, 6, 7, 13, 16]]
    ids, mask = batch(rows)
    f = prefix_forest(ids, mask, max_row_tokens=64)
    seg = f.segments[0][-1]
    assert (seg.start, seg.keys.tolist()) == (13, [0, 1, 2, 8, 13])  # 16 is node 13, after 20 21
    assert seg.spans == ((0, 3), (8, 9), (13, 14))
    torch.manual_seed(0)
    model, _ = load_policy(TINY_MODEL)
    with torch.no_grad():
        plain = token_logprobs(model, ids, mask)
        packed = token_logprobs(model, ids, mask, share_prefixes=True)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
