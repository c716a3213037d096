"""Tiny random-weight models whose KV cache has several groups, for
:func:`umbp.testing.models.write_random_model`.

* :func:`gemma3_text_recipe`: sliding-window and full-attention layers
  (``layer_types``); with prefix caching and a ``SupportsHMA`` connector vLLM
  keeps two groups, ``SlidingWindowSpec`` and ``FullAttentionSpec``.
* :func:`lfm2_recipe`: short-convolution and full-attention layers; two groups,
  ``MambaSpec`` (``mamba_cache_mode="align"`` with prefix caching) and
  ``FullAttentionSpec``.

Both respect the CPU backend's limits (head_dim 32, block size a multiple of 32)
and start an in-process vLLM 0.32 engine with
``make_llm(dir, connector=None, block_size=32)``.
"""

from __future__ import annotations

from umbp.testing.models import ModelRecipe


def gemma3_text_recipe(
    *,
    hidden_size: int = 128,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
    sliding_window: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 4096,
    dtype: str = "float32",
) -> ModelRecipe:
    """Gemma 3 text model; ``layer_types`` entries are ``"sliding_attention"`` or
    ``"full_attention"``. A window shorter than a few blocks makes the sliding
    group's hits differ visibly from the full group's."""
    head_dim = hidden_size // heads
    return ModelRecipe(
        "gemma3_text",
        {
            "hidden_size": hidden_size,
            "intermediate_size": intermediate,
            "num_hidden_layers": len(layer_types),
            "layer_types": list(layer_types),
            "sliding_window": sliding_window,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
        dtype=dtype,
    )


def lfm2_recipe(
    *,
    hidden_size: int = 128,
    layer_types: tuple[str, ...] = ("conv", "full_attention"),
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 4096,
    dtype: str = "float32",
) -> ModelRecipe:
    """LFM2; ``layer_types`` entries are ``"conv"`` (short convolution, a Mamba-
    style state in vLLM) or ``"full_attention"``."""
    return ModelRecipe(
        "lfm2",
        {
            "hidden_size": hidden_size,
            "intermediate_size": intermediate,
            "block_auto_adjust_ff_dim": False,
            # vLLM's LFM2 reads these (the hub's configs carry them);
            # transformers derives both from hidden_size.
            "conv_dim": hidden_size,
            "block_dim": hidden_size,
            "num_hidden_layers": len(layer_types),
            "layer_types": list(layer_types),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
        dtype=dtype,
    )


def qwen3_next_recipe(*, hidden_size: int = 128, vocab: int = 512,
                      max_positions: int = 4096) -> ModelRecipe:
    """Qwen3-Next: a gated delta-net linear-attention layer (a Mamba-style state in
    vLLM, "align" mode) and a full-attention layer, with a tiny mixture of experts.
    vLLM needs bfloat16 and linear head dim 128 on CPU, and raises the block size
    so that one attention page matches the state page (288 tokens here)."""
    return ModelRecipe(
        "qwen3_next",
        {
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
        dtype="bfloat16",
    )


def llama4_text_recipe(*, hidden_size: int = 128, chunk: int = 64, vocab: int = 512,
                       max_positions: int = 4096) -> ModelRecipe:
    """Llama 4 text: a chunked local-attention layer (attention within 64-token
    chunks) and a full-attention layer; dense MLPs (no MoE layers)."""
    return ModelRecipe(
        "llama4_text",
        {
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "intermediate_size_mlp": 2 * hidden_size,
            "num_hidden_layers": 2,
            "layer_types": ["chunked_attention", "full_attention"],
            "no_rope_layers": [1, 0],
            "attention_chunk_size": chunk,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": hidden_size // 4,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "moe_layers": [],
            "interleave_moe_layer_step": 0,
            "vocab_size": vocab,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": False,
        },
    )
