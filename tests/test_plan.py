import json

import pytest
import torch

from common.plan import KNOWN_SHAPES, memory_plan, model_shape, param_counts, print_plan

GiB = 2**30
P_QWEN3_4B = 151936 * 2560 + 36 * 100_930_816 + 2560  # = 4,022,468,096, see the first test


def test_qwen3_4b_parameter_count_by_hand():
    # per layer: q 2560x4096, k and v 2560x1024, o 4096x2560, gate/up/down 2560x9728, 2 norms + q/k norms
    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128
    assert layer == 100_930_816
    n = param_counts(model_shape("Qwen/Qwen3-4B"))
    assert n["layer"] == layer
    assert n["total"] == P_QWEN3_4B == 4_022_468_096  # tied: no separate lm_head (published: "4.0B")


@pytest.mark.parametrize("name", sorted(KNOWN_SHAPES))
def test_counts_match_transformers_built_on_the_meta_device(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = model_shape(name)
    config = AutoConfig.for_model(**shape)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    assert param_counts(shape)["total"] == sum(p.numel() for p in model.parameters())


def test_lora_count_matches_peft_on_the_tiny_model():
    from common.models import TINY_MODEL, load_policy

    # r=2 on q (64->64), k, v (64->32), o (64->64), gate, up (64->128), down (128->64), 2 layers
    by_hand = 2 * 2 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert by_hand == 4096
    model, _ = load_policy(TINY_MODEL, lora_rank=2)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == by_hand
    assert param_counts(model_shape(TINY_MODEL), lora_rank=2)["lora"] == by_hand


def test_full_fine_tune_of_qwen3_4b_on_8_ranks_by_hand():
    plan = memory_plan("Qwen/Qwen3-4B", 8, 0, 8192, 1, "vllm", dtype="bfloat16", vllm_dtype="bfloat16",
                       gradient_checkpointing=True, vllm_sleeps=True, gpu_gib=80, gpu_memory_utilization=0.5)
    P = P_QWEN3_4B
    assert plan["strategy"] == "fsdp2"  # 4.0 B trainable > 1 B
    assert plan["weights"] == P * 2 / 8 and plan["grads"] == P * 2 / 8 and plan["adam"] == 2 * P * 2 / 8
    assert plan["ddp_buckets"] == 0
    assert plan["fsdp_gathered"] == (2 * 100_930_816 + 151936 * 2560) * 2  # 2 layers + tied embedding, bf16
    # checkpointed layer inputs + one layer's activations (4h + 2q + 2kv + 4i per token), bf16
    one_layer = 4 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728
    assert plan["activations"] == 36 * 8192 * 2560 * 2 + 8192 * one_layer * 2
    assert plan["logits"] == 3 * 512 * 151936 * 4
    train = (P * 2 / 8 * 4 + (2 * 100_930_816 + 151936 * 2560) * 2 + 36 * 8192 * 2560 * 2
             + 8192 * 59392 * 2 + 3 * 512 * 151936 * 4)
    assert plan["train_peak"] == pytest.approx(train)
    assert plan["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2 == 147_456
    assert plan["kv_cache"] == 40 * GiB - P * 2
    assert plan["kv_tokens"] == int((40 * GiB - P * 2) // 147_456)
    assert plan["rollout_peak"] == pytest.approx(P * 2 / 8 + 2 * P * 2 / 8 + 40 * GiB)
    assert plan["fits"]


def test_qwen3_4b_as_the_scripts_load_it_today():
    """float32 weights (FSDP2 computes in bf16, keeps fp32 master weights, gradients and AdamW states: 16
    bytes per parameter, sharded), no gradient checkpointing, a float32 vLLM engine."""
    plan = memory_plan("Qwen/Qwen3-4B", 8, 0, 4096, 8, "vllm")
    P = P_QWEN3_4B
    assert plan["weights"] + plan["grads"] + plan["adam"] == P * 16 / 8
    one_layer = 8 * 4096 * (4 * 2560 + 2 * 4096 + 2 * 1024 + 4 * 9728) * 2  # bf16 activations of a layer
    assert plan["activations"] == 36 * one_layer  # 36 layers kept: 130.5 GiB
    assert plan["kv_cache"] == 40 * GiB - P * 4  # a float32 engine, with a float32 KV cache
    assert plan["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 4
    # the engine is not put to sleep: its 40 GiB share stays during training
    train = P * 16 / 8 + (2 * 100_930_816 + 151936 * 2560) * 2 + 36 * one_layer + 3 * 512 * 151936 * 4
    assert plan["train_peak"] == pytest.approx(train + 40 * GiB)
    assert not plan["fits"]


def test_lora_qwen3_8b_is_ddp_with_a_full_replica():
    plan = memory_plan("Qwen/Qwen3-8B", 8, 16, 4096, 2, "vllm")
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    P = 151936 * 4096 * 2 + 36 * layer + 4096  # untied: embedding and lm_head
    T = 16 * 36 * ((4096 + 4096) * 2 + 2 * (4096 + 1024) + 3 * (4096 + 12288))  # LoRA, fp32
    assert (plan["params"], plan["trainable"]) == (P, T) == (8_190_735_360, 43_646_976)
    assert plan["strategy"] == "ddp"
    assert plan["weights"] == P * 4 + T * 4  # float32 base (the default) + fp32 adapter
    # no gradient checkpointing, float32 activations under DDP: every layer's (4h+2q+2kv+4i) per token
    assert plan["activations"] == 36 * 2 * 4096 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 12288) * 4
    assert plan["grads"] == plan["ddp_buckets"] == T * 4 and plan["adam"] == 2 * T * 4
    assert plan["fsdp_gathered"] == 0


def test_one_rank_does_not_shard_and_32b_full_fine_tune_does_not_fit_one_card(capsys):
    plan = memory_plan("Qwen/Qwen2.5-32B-Instruct", 1, 0, 2048, 1, "hf", dtype="bfloat16", gpu_gib=80)
    assert plan["strategy"] == "none"
    assert plan["weights"] == plan["params"] * 2 and plan["adam"] == plan["params"] * 4
    assert not plan["fits"]
    print_plan("Qwen/Qwen2.5-32B-Instruct", 1, 0, 2048, 1, "hf")
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "TRAINING PEAK" in out


def test_local_config_folder_and_unknown_name(tmp_path):
    config = dict(KNOWN_SHAPES["tiny-random"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert param_counts(model_shape(str(tmp_path)))["total"] == 49152 * 64 + 2 * (
        64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    with pytest.raises(ValueError, match="no shape known for model 'no/such-model'"):
        memory_plan("no/such-model", 1, 0, 128, 1, "hf")


def test_random_names_and_short_names_plan_the_published_shape(tmp_path, monkeypatch):
    from common.plan import canonical_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen3-4B").mkdir()  # a local folder of that name is the user's model, not the table's
    assert canonical_name("Qwen3-4B") == "Qwen3-4B"
    monkeypatch.chdir("/")

    assert canonical_name("random:Qwen3-1.7B") == canonical_name("Qwen3-1.7B") == "Qwen/Qwen3-1.7B"
    assert canonical_name("random:smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert canonical_name("no/such-model") == "no/such-model"
    assert model_shape("random:Qwen3-4B") == KNOWN_SHAPES["Qwen/Qwen3-4B"]
    assert memory_plan("random:Qwen3-4B", 1, 0, 128, 1, "hf")["params"] == P_QWEN3_4B


def test_hf_rollout_kv_counts_every_sequence_a_rank_decodes_at_once_by_hand():
    # tiny-random: 49152*64 embedding + 2 layers of (q 64x64, k, v 64x32, o 64x64 = 12288; MLP 3*64*128 =
    # 24576; 2 norms of 64) + the final norm, tied: P = 3,145,728 + 2*36,992 + 64 = 3,219,776
    plan = memory_plan("tiny-random", 2, 0, 100, 4, "hf", rollout_rows=16)
    assert plan["params"] == 3_219_776
    # fp32: K and V of 2 layers x 2 kv heads x 16 dims x 4 B = 512 B per token; weights + AdamW's two
    # moments (12 B per parameter) stay resident while 16 sequences of 100 tokens decode together
    assert plan["kv_bytes_per_token"] == 512
    assert plan["rollout_peak"] == 3_219_776 * 12 + 16 * 100 * 512
    assert any("HF, 16 sequences of 100 decoding at once" in line for line in plan["lines"])
    # not micro_batch rows (what the plan counted before): 4 x 100 x 512
    assert memory_plan("tiny-random", 2, 0, 100, 4, "hf")["rollout_peak"] == 3_219_776 * 12 + 4 * 100 * 512


def test_t2po_dry_run_plans_from_the_envs_prompts(capsys):
    import re

    import t2po
    from envs.base import make_env

    t2po.main(["--dry-run", "--backend", "hf"])  # the default: textworld, 4 tasks x 4 rollouts, 32 held out
    out = capsys.readouterr().out
    found = re.search(r"sequence (\d+) tokens: the longest of (\d+) turn prompts, (\d+) chars / 2 \+ 32 "
                      r"chat-template tokens \+ 96 response", out)
    seq, prompts, chars = (int(x) for x in found.groups())
    assert seq == -(-chars // 2) + 32 + 96 and seq < 4096  # not 4096 + max-new-tokens whatever the env
    # 16 training games played by the expert, 4 turns each (level 4); the first prompt holds the game's
    # first observation, so the longest is at least that long
    env = make_env("textworld", level=4, train_games=16, eval_games=32, holdout="walkthrough")
    assert prompts == 64 and chars > len(env.reset(env.tasks("train")[0])[0])
    assert "rollout rows 32 = max(ceil(4 tasks / 1 ranks) * group 4, 32 held-out responses on rank 0)" in out
    assert f"HF, 32 sequences of {seq} decoding at once" in out
    # an env whose package is missing: the old assumption, said as such
    t2po.main(["--dry-run", "--env", "webshop", "--model", "tiny-random"])
    out = capsys.readouterr().out
    assert "sequence 4396 tokens: 4096 prompt tokens assumed (t2po.py: --env 'webshop'" in out


def test_lora_32b_on_8_ranks_with_one_tensor_parallel_engine_by_hand():
    """LOOP's AppWorld preset (issue 61): Qwen2.5-32B, LoRA r=16, bf16, 8 ranks, --rollout-tp 8. auto shards
    the frozen base (a bf16 replica is 61 GiB of 80), the engine holds 1/8 of its weights and one of the 8
    KV heads on each rank, and the weight push adds one full parameter at a time."""
    plan = memory_plan("Qwen/Qwen2.5-32B-Instruct", 8, 16, 32768, 1, "vllm", dtype="bfloat16",
                       vllm_dtype="bfloat16", gradient_checkpointing=True, vllm_sleeps=True, rollout_tp=8)
    h, i, V, L = 5120, 27648, 152064, 64
    layer = h * h + 2 * h * 1024 + h * h + (h + 2 * 1024) + 3 * h * i + 2 * h  # q, k, v, o + biases, MLP, norms
    P = 2 * V * h + L * layer + h
    T = 16 * L * ((h + h) + 2 * (h + 1024) + (h + h) + 3 * (h + i))
    assert (plan["params"], plan["trainable"]) == (P, T) == (32_763_876_352, 134_217_728)
    assert plan["strategy"] == "fsdp2"  # 134 M trained, but 2 * P bytes > 0.25 * 80 GiB
    assert plan["weights"] == P * 2 / 8 + T * 4 / 8 and plan["adam"] == 2 * T * 4 / 8
    assert plan["engine_weights"] == P * 2 / 8
    assert plan["kv_bytes_per_token"] == 2 * L * 1 * 128 * 2  # one KV head of 8 per rank
    resident = P * 2 / 8 + T * 4 / 8 + 2 * T * 4 / 8
    assert plan["rollout_peak"] == pytest.approx(resident + 40 * GiB)
    # the push: the largest adapted linear (h x i) gathered in bf16, B A in fp32 and its scaled copy, the
    # bf16 cast and the sum; more than the largest tensor, the 152064 x 5120 embedding, gathered alone
    assert plan["push_peak"] == pytest.approx(resident + 40 * GiB + h * i * (2 + 8 + 2 * 2))
    assert plan["peak"] == plan["push_peak"] < 0.9 * 80 * GiB and plan["fits"]
    # one tensor-parallel-1 engine per rank (what the code did before): 61 GiB of engine weights per rank
    alone = memory_plan("Qwen/Qwen2.5-32B-Instruct", 8, 16, 32768, 1, "vllm", dtype="bfloat16",
                        vllm_dtype="bfloat16", gradient_checkpointing=True, vllm_sleeps=True)
    assert alone["engine_weights"] == P * 2 and alone["kv_cache"] == 0  # its 40 GiB share holds no cache


def test_rollout_tp_that_the_model_or_the_ranks_cannot_split_is_refused():
    with pytest.raises(ValueError, match="--rollout-tp 3: vLLM splits the 40 attention heads and 8 KV heads"):
        memory_plan("Qwen/Qwen2.5-32B-Instruct", 6, 16, 1024, 1, "vllm", rollout_tp=3)
    with pytest.raises(ValueError, match="--rollout-tp 4 does not divide the 6 ranks"):
        memory_plan("Qwen/Qwen2.5-32B-Instruct", 6, 16, 1024, 1, "vllm", rollout_tp=4)
    with pytest.raises(ValueError, match="--rollout-tp 2 needs the vllm backend"):
        memory_plan("Qwen/Qwen3-4B", 2, 0, 1024, 1, "hf", rollout_tp=2)
    # 16 ranks of an engine and 8 KV heads: each rank holds one, a copy
    assert memory_plan("Qwen/Qwen3-8B", 16, 0, 1024, 1, "vllm", rollout_tp=16)["kv_bytes_per_token"] == \
        2 * 36 * 1 * 128 * 4


def test_an_engine_whose_weights_leave_no_cache_for_one_sequence_does_not_fit():
    """32B with one tensor-parallel-1 engine per rank: FSDP2 makes training fit, but the engine's 61 GiB of
    bf16 weights exceed its 40 GiB share, so vLLM could not start: the plan must not say it fits."""
    kwargs = dict(dtype="bfloat16", vllm_dtype="bfloat16", gradient_checkpointing=True, vllm_sleeps=True,
                  strategy="fsdp2")
    alone = memory_plan("Qwen/Qwen2.5-32B-Instruct", 8, 16, 32768, 1, "vllm", **kwargs)
    assert alone["peak"] < 0.9 * 80 * GiB and alone["kv_cache"] == 0 and not alone["fits"]
    assert any(line.startswith("vLLM cannot start: its share holds its weights (61.03 GiB)")
               for line in alone["lines"])
    assert "does NOT fit: one engine over several ranks (--rollout-tp N" in alone["lines"][-1]
    # --rollout-tp 2: 30.5 GiB of weights per rank leave 9.5 GiB, 2.4 sequences of 32768 tokens
    assert memory_plan("Qwen/Qwen2.5-32B-Instruct", 8, 16, 32768, 1, "vllm", rollout_tp=2, **kwargs)["fits"]
