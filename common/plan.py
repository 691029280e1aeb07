"""Per-rank GPU memory plan for a run, from the model's shape alone (no weights loaded): the scripts'
`--dry-run`. Every number is printed with its arithmetic so it can be checked by hand.

What one rank holds (W ranks, P parameters of which T are trained):
- training: weights P·b (FSDP2: /W), gradients T·b_t, AdamW's two moments 2·T·b_t (torch keeps them in
  the parameter's dtype), DDP's gradient buckets (another T·b_t), FSDP2's all-gathered layers,
  activations under gradient checkpointing (every layer's input + one layer recomputed in full) and the
  chunked vocabulary projection;
- rollout (vLLM colocated on the same GPU): `gpu_memory_utilization` of the card for its own bf16
  weights and the KV cache, 2·layers·kv_heads·head_dim·2 bytes per token; it sleeps while training runs.
  With --rollout-tp N the N ranks of a group are one tensor-parallel engine: each holds 1/N of its
  weights and of its KV heads (at least one head). The share must leave a KV cache for one sequence of
  the longest length, or vLLM does not start (the plan then does not fit);
- the weight push after each update (common.dist.full_weights into the awake engine): the resident
  training state, the engine's share, and one full parameter at a time, gathered from its shards, with
  its LoRA delta (never a second copy of the model).
These are estimates of the big tensors, not a profile: the CUDA context, allocator fragmentation and
vLLM's own activation peak come on top (keep ~10% of the card free).
"""

import json
import os

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FSDP2_THRESHOLD = 1e9  # trainable parameters past which --parallel auto shards (auto_strategy)
REPLICA_SHARE = 0.25  # share of the card past which a bf16 replica of the weights is sharded (auto_strategy)


def auto_strategy(params: int, trainable: int, card_bytes: float | None) -> str:
    """--parallel auto (common.dist.choose_strategy, and --dry-run): "fsdp2" when more than a billion
    parameters train (a replica of weights, gradients and AdamW states is 16 bytes a parameter), or when
    a replica of all the weights in bf16 (2 bytes a parameter) would take more than REPLICA_SHARE of the
    card, trained or frozen (LoRA on a 32B base: 61 GiB of an 80 GiB card); "ddp" otherwise. Off the GPU
    (card_bytes None) only the first rule applies."""
    if trainable > FSDP2_THRESHOLD:
        return "fsdp2"
    if card_bytes is not None and 2 * params > REPLICA_SHARE * card_bytes:
        return "fsdp2"
    return "ddp"

# Shapes from each model's published config.json on the Hugging Face hub
# (https://huggingface.co/<name>/blob/main/config.json); tiny-random is common.models.build_tiny_random;
# tiny-qwen3 (ours) is Qwen3's layout at toy size with its full vocabulary, for `random:tiny-qwen3` on a CPU.
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128)
_QWEN25 = dict(model_type="qwen2", vocab_size=152064, tie_word_embeddings=False)
KNOWN_SHAPES: dict[str, dict] = {
    "Qwen/Qwen3-0.6B": dict(_QWEN3, num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
                            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, num_hidden_layers=28, hidden_size=2048, intermediate_size=6144,
                            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(_QWEN3, num_hidden_layers=36, hidden_size=2560, intermediate_size=9728,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(_QWEN3, num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen2.5-7B-Instruct": dict(_QWEN25, num_hidden_layers=28, hidden_size=3584,
                                     intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4),
    "Qwen/Qwen2.5-32B-Instruct": dict(_QWEN25, num_hidden_layers=64, hidden_size=5120,
                                      intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        model_type="llama", vocab_size=49152, num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    "tiny-random": dict(model_type="llama", vocab_size=49152, num_hidden_layers=2, hidden_size=64,
                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=True),
    "tiny-qwen3": dict(_QWEN3, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
ALIASES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct":
           "HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-7B": "Qwen/Qwen2.5-7B-Instruct",
           "Qwen/Qwen2.5-32B": "Qwen/Qwen2.5-32B-Instruct"}


def canonical_name(name: str) -> str:
    """The table's key for `name`: itself, an alias, or a key without its owner (Qwen3-4B); `random:` (a
    random-init model of that shape, common.models) dropped. Unknown names and local folders come back
    unchanged."""
    if os.path.isdir(name):
        return name
    name = name.removeprefix("random:")
    name = ALIASES.get(name, name)
    owners = [k for k in KNOWN_SHAPES if k.split("/")[-1] == name]
    return owners[0] if name not in KNOWN_SHAPES and len(owners) == 1 else name


def model_shape(name: str) -> dict:
    """config.json fields of `name`: the table above, a local folder, or the local HF cache (no download)."""
    name = canonical_name(name)
    if name in KNOWN_SHAPES:
        return dict(KNOWN_SHAPES[name])
    path = os.path.join(name, "config.json") if os.path.isdir(name) else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
            path = cached if isinstance(cached, str) else None
        except Exception:
            path = None
    if path is None or not os.path.isfile(path):
        raise ValueError(f"no shape known for model {name!r}: use one of {sorted(KNOWN_SHAPES)} or a local "
                         "folder with config.json")
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("tie_word_embeddings", False)
    return config


def param_counts(shape: dict, lora_rank: int = 0) -> dict:
    """Parameter counts of a llama/qwen decoder: per layer, whole model, LoRA (all linear layers of the
    decoder, lm_head excluded, as common.models.load_policy sets it up)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    L, V = shape["num_hidden_layers"], shape["vocab_size"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd  # projection widths
    attn = h * q + 2 * h * kv + q * h  # q, k, v, o
    if shape.get("model_type") == "qwen2" or shape.get("attention_bias"):
        attn += q + 2 * kv  # q/k/v biases
    norms = 2 * h + (2 * hd if shape.get("model_type") == "qwen3" else 0)  # + Qwen3's q_norm, k_norm
    layer = attn + 3 * h * i + norms  # gate, up, down
    embed = V * h
    lm_head = 0 if shape.get("tie_word_embeddings") else V * h
    total = embed + L * layer + h + lm_head  # + final norm
    # LoRA r on a (d_in -> d_out) linear adds r·(d_in + d_out)
    lora = lora_rank * L * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i)) if lora_rank > 0 else 0
    return {"layer": layer, "embed": embed, "lm_head": lm_head, "total": total, "lora": lora,
            "head_dim": hd, "q_width": q, "kv_width": kv}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def memory_plan(model_name: str, world_size: int, lora_rank: int, max_seq_len: int, micro_batch: int,
                backend: str, *, strategy: str = "auto", dtype: str = "float32", vllm_dtype: str = "float32",
                gradient_checkpointing: bool = False, vllm_sleeps: bool = False, gpu_gib: float = 80.0,
                gpu_memory_utilization: float = 0.5, chunk_size: int = 512, rollout_rows: int = 0,
                rollout_tp: int = 1) -> dict:
    """Bytes per rank for each item (see the module docstring) and `lines`, the arithmetic as text.

    The defaults are what the scripts do today: weights loaded in float32 (load_policy's default; loop's
    --dtype), the vLLM engine in float32 (VLLMGenerator's default), no gradient checkpointing, vLLM's share
    0.5 of the card, and the engine kept awake during training (no script calls generator.sleep() yet;
    vllm_sleeps=True counts it as freed). backend "auto" counts as vLLM (what auto picks on a GPU).
    chunk_size: tokens per vocabulary-projection chunk (common.logprobs). rollout_rows: the sequences a rank
    decodes at once with the HF backend, which generates a whole batch together (0: micro_batch).
    rollout_tp: ranks per tensor-parallel vLLM engine (--rollout-tp)."""
    if world_size < 1 or micro_batch < 1 or max_seq_len < 1 or rollout_tp < 1:
        raise ValueError("world_size, micro_batch, max_seq_len and rollout_tp must be >= 1")
    if world_size % rollout_tp:
        raise ValueError(f"--rollout-tp {rollout_tp} does not divide the {world_size} ranks")
    if dtype not in DTYPE_BYTES or vllm_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} or {vllm_dtype!r}; use {sorted(DTYPE_BYTES)}")
    shape = model_shape(model_name)
    n = param_counts(shape, lora_rank)
    L, h, i = shape["num_hidden_layers"], shape["hidden_size"], shape["intermediate_size"]
    V = shape["vocab_size"]
    kv_heads, hd = shape["num_key_value_heads"], n["head_dim"]
    P = n["total"]
    T = n["lora"] if lora_rank > 0 else P
    why = ""
    if strategy == "auto":
        strategy = auto_strategy(P, T, gpu_gib * GiB)
        why = (f" (--parallel auto: {T / 1e9:.2f} B trained > 1 B" if T > FSDP2_THRESHOLD else
               f" (--parallel auto: a bf16 replica 2*P = {_gib(2 * P)} {'>' if strategy == 'fsdp2' else '<='} "
               f"{REPLICA_SHARE}*{gpu_gib:g} GiB") + ")"
    if world_size == 1:
        strategy, why = "none", ""
    b = DTYPE_BYTES[dtype]
    bt = 4 if lora_rank > 0 else b  # peft creates LoRA weights in fp32 (autocast_adapter_dtype)
    a = 2 if (b == 2 or strategy == "fsdp2") else 4  # activation bytes: FSDP2 computes in bf16 on GPU
    shard = world_size if strategy == "fsdp2" else 1
    lines = [f"model {model_name}: {L} layers, hidden {h}, intermediate {i}, heads "
             f"{shape['num_attention_heads']} (kv {kv_heads}) x {hd}, vocab {V}, "
             f"{'tied' if not n['lm_head'] else 'untied'} embeddings",
             f"parameters P = {V}*{h} embed + {L}*{n['layer']:,} per layer + {h} norm"
             + (f" + {n['lm_head']:,} lm_head" if n["lm_head"] else "") + f" = {P:,} ({P / 1e9:.2f} B)"]
    if lora_rank > 0:
        lines.append(f"trainable T = LoRA r={lora_rank} on 7 linears x {L} layers = {T:,} ({T / 1e6:.1f} M)")
    else:
        lines.append("trainable T = P (full fine-tune)")
    lines.append(f"strategy {strategy}{why} on {world_size} rank(s); weights {dtype} ({b} B), trained "
                 f"weights {bt} B, activations {a} B" + (f"; FSDP2 shards by {shard}" if shard > 1 else ""))

    weights = P * b / shard + (T * bt / shard if lora_rank > 0 else 0)
    grads = T * bt / shard
    adam = 2 * T * bt / shard
    buckets = T * bt if strategy == "ddp" else 0  # DDP's default gradient buckets are a second copy
    gathered = 0
    if strategy == "fsdp2":  # one layer in use + one prefetched, and the root (embedding, lm_head) in bf16
        gathered = (2 * n["layer"] + n["embed"] + n["lm_head"]) * 2
    # a layer's activations saved for backward, per token: 2 norm inputs + 2 norm outputs (4h), q and the
    # attention output (2q), k and v (2kv), gate, up, silu(gate), gate*up (4i)
    layer_elems = 4 * h + 2 * n["q_width"] + 2 * n["kv_width"] + 4 * i
    one_layer = micro_batch * max_seq_len * layer_elems * a
    if gradient_checkpointing:  # each layer's input kept; one layer recomputed in full during backward
        checkpoints = L * micro_batch * max_seq_len * h * a
    else:  # every layer's activations kept
        checkpoints, one_layer = (L - 1) * one_layer, one_layer
    logits = 3 * chunk_size * V * 4  # fp32 logits, log-softmax, their gradient, for one chunk
    train = weights + grads + adam + buckets + gathered + checkpoints + one_layer + logits
    fmt = f"/{shard}" if shard > 1 else ""
    lines += [
        f"weights     {P:,}*{b}{fmt}" + (f" + LoRA {T:,}*{bt}{fmt}" if lora_rank > 0 else "")
        + f" = {_gib(weights)}",
        f"gradients   {T:,}*{bt}{fmt} = {_gib(grads)}",
        f"AdamW m, v  2*{T:,}*{bt}{fmt} = {_gib(adam)}",
    ]
    if buckets:
        lines.append(f"DDP buckets {T:,}*{bt} = {_gib(buckets)}")
    if gathered:
        lines.append(f"FSDP2 gathered (2 layers + embed/lm_head, bf16) (2*{n['layer']:,} + {n['embed']:,} + "
                     f"{n['lm_head']:,})*2 = {_gib(gathered)}")
    if gradient_checkpointing:
        lines += [f"activations (grad. checkpointing) {L} layers*{micro_batch} seqs*{max_seq_len} tok*{h}"
                  f"*{a} = {_gib(checkpoints)}",
                  f"  + one layer recomputed {micro_batch}*{max_seq_len}*{layer_elems:,} (4h+2q+2kv+4i)"
                  f"*{a} = {_gib(one_layer)}"]
    else:
        lines.append(f"activations (no grad. checkpointing) {L} layers*{micro_batch} seqs*{max_seq_len} tok*"
                     f"{layer_elems:,} (4h+2q+2kv+4i)*{a} = {_gib(checkpoints + one_layer)}")
    lines += [
        f"logits chunk 3*{chunk_size} tok*{V}*4 = {_gib(logits)}",
        f"TRAINING PEAK per rank = {_gib(train)}",
    ]

    vllm = backend in ("vllm", "auto")
    if rollout_tp > 1 and not vllm:
        raise ValueError(f"--rollout-tp {rollout_tp} needs the vllm backend: the HF backend has no "
                         "tensor-parallel engine")
    heads = shape["num_attention_heads"]
    if heads % rollout_tp or (kv_heads % rollout_tp and rollout_tp % kv_heads):
        raise ValueError(f"--rollout-tp {rollout_tp}: vLLM splits the {heads} attention heads and {kv_heads} "
                         "KV heads evenly across the ranks of an engine; choose a divisor of both")
    # vLLM gives each rank of a tensor-parallel engine kv_heads / N KV heads, or one (copied) when N > kv_heads
    kv_heads_rank = max(1, kv_heads // rollout_tp) if vllm else kv_heads
    kv_b = DTYPE_BYTES[vllm_dtype] if vllm else a  # vLLM's cache has the engine's dtype; HF the model's
    kv_token = 2 * L * kv_heads_rank * hd * kv_b  # K and V, every layer (a rank's heads)
    out = {"model": model_name, "strategy": strategy, "world_size": world_size, "params": P, "trainable": T,
           "weights": weights, "grads": grads, "adam": adam, "ddp_buckets": buckets,
           "fsdp_gathered": gathered, "activations": checkpoints + one_layer, "logits": logits,
           "train_peak": train, "kv_bytes_per_token": kv_token, "rollout_tp": rollout_tp}
    lines.append(f"KV cache per token 2*{L} layers*{kv_heads_rank} kv heads*{hd}*{kv_b} B = {kv_token:,} B "
                 f"({kv_token * max_seq_len / GiB:.2f} GiB per {max_seq_len}-token sequence)"
                 + (f", on each of the engine's {rollout_tp} ranks" if rollout_tp > 1 else ""))
    resident = weights + adam  # what stays on the GPU while vLLM rolls out (gradients set to None)
    push = 0.0
    if vllm:
        share = gpu_memory_utilization * gpu_gib * GiB
        vb = DTYPE_BYTES[vllm_dtype]
        engine_weights = P * vb / rollout_tp
        kv_cache = max(0.0, share - engine_weights)
        rollout = resident + share
        if not vllm_sleeps:  # the engine keeps its share while the policy trains
            train += share
        tp = f"/{rollout_tp}" if rollout_tp > 1 else ""
        if rollout_tp > 1:
            lines.append(f"vLLM tensor-parallel over {rollout_tp} ranks (--rollout-tp {rollout_tp}): each "
                         f"rank holds 1/{rollout_tp} of the engine's weights and {kv_heads_rank} of its "
                         f"{kv_heads} KV heads; the group generates the union of its ranks' prompts")
        lines += [
            f"vLLM share {gpu_memory_utilization}*{gpu_gib:g} GiB = {_gib(share)}: its {vllm_dtype} weights "
            f"{P:,}*{vb}{tp} = {_gib(engine_weights)}, KV cache {_gib(kv_cache)} = "
            f"{int(kv_cache // kv_token):,} tokens = {kv_cache / kv_token / max_seq_len:.1f} sequences of "
            f"{max_seq_len}" + (" for the group" if rollout_tp > 1 else ""),
            f"ROLLOUT PEAK per rank = weights + AdamW (resident) + vLLM share = {_gib(rollout)}",
            "training with vLLM asleep (weights to host memory, KV cache freed): TRAINING PEAK as above"
            if vllm_sleeps else f"vLLM stays awake while training: TRAINING PEAK + its share = {_gib(train)}",
        ]
        # the push after each update (common.dist.full_weights): one full parameter at a time besides the
        # resident state and the awake engine; FSDP2 gathers it from the shards, LoRA adds B A in fp32
        # (the product and its scaled copy), its cast and the merged sum
        biggest = max(V * h, h * i, h * n["q_width"])  # embedding / lm_head, or the largest linear
        linear = max(h * i, h * n["q_width"])  # the largest linear LoRA adapts
        gathered_b = b if strategy == "fsdp2" else 0
        if lora_rank > 0:
            push = max(biggest * gathered_b, linear * (gathered_b + 8 + 2 * b))
            how = (f"max(largest tensor {biggest:,}*{gathered_b}, largest adapted linear {linear:,}*"
                   f"({gathered_b} gathered + 8 fp32 B A + 2*{b} cast and sum))")
        else:
            push = biggest * gathered_b
            how = f"largest tensor {biggest:,}*{gathered_b}" + (" gathered" if gathered_b else "")
        push_peak = resident + share + push
        lines.append(f"WEIGHT PUSH PEAK per rank = resident + vLLM share + one full parameter {how} "
                     f"= {_gib(resident)} + {_gib(share)} + {_gib(push)} = {_gib(push_peak)}")
        rollout = max(rollout, push_peak)
        out["train_peak"] = train
        out.update(vllm_share=share, kv_cache=kv_cache, kv_tokens=int(kv_cache // kv_token),
                   rollout_peak=resident + share, push_peak=push_peak, engine_weights=engine_weights)
    else:
        rows = rollout_rows or micro_batch
        rollout = resident + rows * max_seq_len * kv_token
        lines.append(f"ROLLOUT PEAK per rank (HF, {rows} sequences of {max_seq_len} decoding at once) = "
                     f"weights + AdamW + KV {rows}*{max_seq_len}*{kv_token:,} B = {_gib(rollout)}")
        out.update(rollout_peak=rollout)
    peak = max(train, rollout)
    fits = peak <= 0.9 * gpu_gib * GiB
    advice = ("use more ranks (FSDP2), --lora-rank, bf16, gradient checkpointing, a smaller micro-batch, "
              "shorter sequences or a smaller vLLM share")
    # vLLM refuses to start when its share leaves no KV cache for one sequence of the longest length
    engine_starts = not vllm or out["kv_cache"] >= kv_token * max_seq_len
    if not engine_starts:
        lines.append(f"vLLM cannot start: its share holds its weights ({_gib(out['engine_weights'])}) and "
                     f"{_gib(out['kv_cache'])} of KV cache, less than one {max_seq_len}-token sequence "
                     f"({_gib(kv_token * max_seq_len)})")
        advice = ("one engine over several ranks (--rollout-tp N holds 1/N of the weights on each) or a "
                  "larger vLLM share")
    fits = fits and engine_starts
    lines.append(f"PEAK {_gib(peak)} of {gpu_gib:g} GiB: "
                 + ("fits (with 10% kept free)" if fits else f"does NOT fit: {advice}"))
    out.update(peak=peak, fits=fits, lines=lines)
    return out


def print_plan(model_name: str, world_size: int, lora_rank: int, max_seq_len: int, micro_batch: int,
               backend: str, **kwargs) -> None:
    """Print `memory_plan`'s arithmetic (the scripts' --dry-run)."""
    print("\n".join(memory_plan(model_name, world_size, lora_rank, max_seq_len, micro_batch, backend,
                                **kwargs)["lines"]))


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="per-rank memory plan (no weights loaded)")
    p.add_argument("--model", default="Qwen/Qwen3-4B")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--backend", default="vllm")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--vllm-sleeps", action="store_true")
    p.add_argument("--gpu-gib", type=float, default=80.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp2"])
    p.add_argument("--rollout-tp", type=int, default=1, help="ranks per tensor-parallel vLLM engine")
    a = p.parse_args()
    print_plan(a.model, a.world_size, a.lora_rank, a.max_seq_len, a.micro_batch, a.backend, dtype=a.dtype,
               vllm_dtype=a.vllm_dtype, gradient_checkpointing=a.gradient_checkpointing,
               vllm_sleeps=a.vllm_sleeps, gpu_gib=a.gpu_gib,
               gpu_memory_utilization=a.gpu_memory_utilization, strategy=a.strategy, rollout_tp=a.rollout_tp)
