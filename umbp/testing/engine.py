"""Drive a real vLLM engine on token-id prompts (no tokenizer, no model hub)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONNECTOR = "UMBPStoreConnector"


def kv_transfer_config(extra: Mapping[str, object], role: str = "kv_both") -> dict[str, object]:
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": "umbp",
        "kv_role": role,
        "kv_connector_extra_config": dict(extra),
    }


def make_llm(
    model_dir: str,
    *,
    connector: Mapping[str, object] | None,
    block_size: int = 32,
    dtype: str = "float32",
    max_model_len: int = 2048,
    kv_cache_bytes: int = 64 << 20,
    enable_prefix_caching: bool = True,
    **engine_args: Any,
) -> Any:
    from vllm import LLM

    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=enable_prefix_caching,
        block_size=block_size,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        load_format="safetensors",
        seed=0,
        kv_transfer_config=None if connector is None else kv_transfer_config(connector),
        **engine_args,
    )


@dataclass(frozen=True, slots=True)
class Completion:
    token_ids: tuple[int, ...]
    num_cached_tokens: int
    seconds: float


def generate(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> list[Completion]:
    """Greedy generation of all prompts in one batch; ``kv_transfer_params`` reach the
    connector as a ``vllm serve`` request body's would (``{"umbp": {"retain_s": N}}``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if kv_transfer_params is None else {"kv_transfer_params": dict(kv_transfer_params)}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False,
                            ignore_eos=True, extra_args=extra)
    started = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - started
    return [
        Completion(tuple(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), elapsed)
        for o in outputs
    ]


def time_to_first_token(llm: Any, prompt: Sequence[int]) -> tuple[float, Completion]:
    """Seconds to produce one token for one prompt: prefill (or restore) cost."""
    started = time.perf_counter()
    completion = generate(llm, [prompt], max_tokens=1)[0]
    return time.perf_counter() - started, completion


def shared_prefix_prompts(
    count: int, prefix_tokens: int, suffix_tokens: int, vocab: int = 500, seed: int = 7
) -> list[list[int]]:
    """Prompts sharing one long prefix, each with its own suffix."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(prefix_tokens)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(suffix_tokens)] for _ in range(count)]


def unique_prompts(count: int, tokens: int, vocab: int = 500, seed: int = 11) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(tokens)] for _ in range(count)]


def steps_in_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in this process (stepped only by its caller),
    not in its own process (which steps itself)."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(getattr(llm.llm_engine, "engine_core", None), InprocClient)


def empty_vllm_cache(llm: Any, timeout_s: float = 60.0) -> None:
    """vLLM's ``reset_prefix_cache()``, until it succeeds. umbp's stores run after
    the step that computed their blocks, which stay pinned until the store is
    acknowledged; vLLM refuses to reset while a block is in use. An engine core in
    this process is stepped meanwhile (nothing else steps it between two
    ``generate`` calls), one in its own process steps itself."""
    in_process = steps_in_process(llm)
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM did not empty its prefix cache within {timeout_s} s")
        if in_process:
            llm.llm_engine.step()
        time.sleep(0.005)


def local_connector() -> Any:
    """The worker-role connector of an engine running in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None
