"""Run under `torchrun --nproc-per-node N` (2 or 8): FSDP2 checkpoints and the FSDP2 weight iterator.

argv: out_dir lora_rank [single_process_checkpoint_dir]
1. (if given) resume a checkpoint written by ONE process into the N-rank FSDP2 model: rank 0 saves the
   gathered parameters and optimizer state to <out>/from_one.pt;
2. from the same init, two AdamW steps under FSDP2 (each rank its shard of a fixed batch, loss / global
   token count * world size), then save_checkpoint; rank 0 saves the parameters and optimizer state
   gathered directly with DTensor.full_tensor() (not through the checkpoint code) to <out>/reference.pt,
   and dict(full_weights(model)) to <out>/full_weights.pt;
3. one more step; rank 0 saves the parameters to <out>/next.pt (a resumed single process must match).
"""

import sys

import torch

from common import dist
from common.checkpoint import load_checkpoint, save_checkpoint
from common.models import TINY_MODEL, load_policy

BATCH = torch.randint(3, 400, (4, 12), generator=torch.Generator().manual_seed(0))  # (4, 12), all ranks


def make(lora_rank: int):
    torch.manual_seed(0)  # identical init on every rank (and in the single process of the test)
    model, _ = load_policy(TINY_MODEL, lora_rank=lora_rank)
    return model


def train_step(model, optimizer, rows: list[int], n_tokens: int, scale: int) -> None:
    """Sum of token NLLs over `rows` / the global token count * scale (see common/dist.py). A rank without
    a row runs row 0 with weight 0: the forward and backward are collectives under FSDP2, as the scripts'
    dist.same_count placeholders."""
    ids = BATCH[rows or [0]]  # (b, 12)
    logits = model(input_ids=ids).logits[:, :-1].float()  # (b, 11, V)
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    (nll * float(bool(rows)) / n_tokens * scale).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def gathered(model, optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: dist.full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    optim = {names[id(p)]: {k: dist.full_tensor(v).clone() for k, v in s.items()}
             for p, s in optimizer.state.items()}
    return {"params": params, "optim": optim}


def sharded(lora_rank: int):
    model = dist.wrap(make(lora_rank), "fsdp2")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


@dist.entrypoint
def main(out: str, lora_rank: int, single: str | None) -> None:
    dist.init(timeout_s=120)
    if single:
        model, optimizer = sharded(lora_rank)
        state = load_checkpoint(single, model, optimizer)
        result = gathered(model, optimizer)
        if dist.is_main():
            torch.save({"step": state["step"], **result}, f"{out}/from_one.pt")

    model, optimizer = sharded(lora_rank)
    assert dist.is_sharded(model)
    rows = dist.shard(list(range(4)))
    for _ in range(2):
        train_step(model, optimizer, rows, 4 * 11, dist.grad_scale())
    save_checkpoint(f"{out}/run", 2, model, optimizer, {"lora_rank": lora_rank})
    reference = gathered(model, optimizer)
    weights = {k: v.clone() for k, v in dist.full_weights(model)}
    if dist.is_main():
        torch.save(reference, f"{out}/reference.pt")
        torch.save(weights, f"{out}/full_weights.pt")
    train_step(model, optimizer, rows, 4 * 11, dist.grad_scale())
    after = gathered(model, optimizer)["params"]
    if dist.is_main():
        torch.save(after, f"{out}/next.pt")
    dist.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
