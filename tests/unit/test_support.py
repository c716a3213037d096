"""Set-ups umbp does not serve stop the engine with a message that says what to
change; a prefix cache vLLM itself switched off makes umbp step aside."""

from __future__ import annotations

from returns.result import Failure, Success

from umbp.core.support import Support, SupportInputs, check_support


def test_a_plain_set_up_is_served() -> None:
    assert check_support(SupportInputs(1, True)) == Success(Support(active=True))


def test_pipeline_parallelism_fails_naming_the_setting_to_change() -> None:
    result = check_support(SupportInputs(pipeline_parallel_size=2, prefix_caching_enabled=True))
    assert isinstance(result, Failure)
    assert "pipeline_parallel_size=2" in result.failure()
    assert "set pipeline_parallel_size=1" in result.failure()


def test_pipeline_parallelism_fails_even_when_umbp_would_step_aside() -> None:
    result = check_support(SupportInputs(2, False, prefix_caching_possible=False))
    assert isinstance(result, Failure) and "pipeline" in result.failure()


def test_prefix_caching_switched_off_by_the_user_fails_saying_enable_it() -> None:
    result = check_support(SupportInputs(1, prefix_caching_enabled=False))
    assert isinstance(result, Failure)
    assert "enable prefix caching" in result.failure()
    assert "block hashes" in result.failure()


def test_prefix_caching_switched_off_by_vllm_makes_umbp_inactive_with_a_warning() -> None:
    result = check_support(SupportInputs(
        1, False, prefix_caching_possible=False,
        prefix_caching_off_reason="vLLM switches it off for MLA attention on this CPU",
    ))
    support = result.unwrap()
    assert not support.active
    assert support.warning is not None
    assert support.warning.startswith("umbp disabled: prefix caching is off for this model")
    assert "MLA" in support.warning


def test_a_model_vllm_cannot_prefix_cache_is_served_when_the_cache_is_on_anyway() -> None:
    # Only the state of the cache matters once it is on.
    assert check_support(SupportInputs(1, True, prefix_caching_possible=False)).unwrap().active
