"""Run under `torchrun --nproc-per-node 2`: one vLLM engine per rank (distributed_executor_backend=
"external_launcher", tensor-parallel 1, as VLLMGenerator sets it up under torchrun), each rank with its
own prompts; then the same weight update on every rank, pushed with update_weights. Rank 0 writes
argv[1]/result.json: per rank, greedy tokens from vLLM and from the HF backend before and after the update.
argv[2] "no-weights": the model folder holds its config and tokenizer only, as random:<shape> does, so the
engine starts on vLLM's dummy weights and serves the policy only through the weight push."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of host memory per engine

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from common import dist  # noqa: E402
from common.generation import HFGenerator, make_generator  # noqa: E402
from common.models import TINY_MODEL, resolve_model_path  # noqa: E402

PROMPTS = [[1, 504, 3458, 314, 253], [1, 9906, 28, 702, 6185, 30, 4070, 9081, 17]]


def make_model(tokenizer) -> LlamaForCausalLM:
    """The vLLM tests' model: head_dim 64 (vLLM's CPU attention has no kernel for smaller), sharpened."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)  # identical on every rank
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    return model


def greedy(generator, prompt: list[int]) -> list[int]:
    return generator.generate([prompt], max_new_tokens=8, temperature=0.0)[0][0].token_ids


@dist.entrypoint
def main(out: str, weights: str = "saved") -> None:
    dist.init(timeout_s=600)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TINY_MODEL))
    model = make_model(tokenizer)
    folder = os.path.join(out, "model")
    if dist.is_main():
        if weights == "saved":
            model.save_pretrained(folder)
        else:
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    dist.barrier()
    engine = make_generator("vllm", model, tokenizer, folder, max_model_len=256, enforce_eager=True)
    hf = HFGenerator(model, tokenizer)
    prompt = PROMPTS[dist.rank()]  # each rank rolls out its own prompt
    result = {"vllm_before": greedy(engine, prompt), "hf_before": greedy(hf, prompt),
              "load_format": str(engine.llm.llm_engine.vllm_config.load_config.load_format)}
    if dist.rank() == 0:  # ranks call generate a different number of times (multi-turn rollouts do)
        greedy(engine, PROMPTS[1])
    with torch.no_grad():
        torch.manual_seed(1)
        model.model.layers[0].mlp.down_proj.weight.add_(torch.randn_like(model.model.layers[0].mlp.down_proj.weight))
        model.lm_head.weight.mul_(-1.0)  # tied with the embedding: flips which tokens are likely
    engine.update_weights(model)
    result.update(vllm_after=greedy(engine, prompt), hf_after=greedy(hf, prompt))
    results = dist.all_gather_object(result)
    if dist.is_main():
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f)
    dist.cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
