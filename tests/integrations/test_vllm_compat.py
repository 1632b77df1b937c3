"""``kvoffload.integrations.vllm.compat`` against the installed vLLM (0.33 here; 0.32 runs in
tests/e2e_vllm's engine venv)."""

from tests.vllm_required import need_vllm

need_vllm()

import pytest  # noqa: E402

from kvoffload.integrations.vllm import compat  # noqa: E402


@pytest.mark.parametrize(
    ("text", "version"),
    [("0.32.0", (0, 32)), ("0.33.0rc1+cpu", (0, 33)), ("0.33.1.dev3", (0, 33)), ("1.0", (1, 0))],
)
def test_parse_version(text: str, version: tuple[int, int]) -> None:
    assert compat.parse_version(text) == version


def test_parse_version_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        compat.parse_version("dev")


def test_installed_vllm_is_supported() -> None:
    assert compat.check_supported() == (0, 33)
    assert compat.is_supported((0, 32))
    assert not compat.is_supported((0, 34))


def test_the_tier_poll_interval_reaches_vllms_tiering_manager() -> None:
    """0.33 takes ``tier_poll_interval_s``; kvoffload's subclass passes it on through
    ``**kwargs``, so the keyword must not be filtered out by the subclass's signature."""
    from kvoffload.integrations.vllm.scheduler.tiering import KVOffloadTieringManager

    kwargs = compat.tiering_manager_kwargs(KVOffloadTieringManager, tier_poll_interval_s=0.5)
    assert kwargs == {"tier_poll_interval_s": 0.5}
    assert compat.tiering_manager_kwargs(KVOffloadTieringManager, no_such_keyword=1) == {}
