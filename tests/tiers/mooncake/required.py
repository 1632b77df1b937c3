"""Guard for the Mooncake tier's tests: skip without the wheel, unless CI requires it.

``need_mooncake()`` at the top of a test module skips it (with the reason)
where ``mooncake.store`` cannot be imported (no wheel, or no
``libibverbs.so.1``); with ``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (``.ci/run``) that is
an error instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import os

import pytest


def need_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if os.environ.get("KVOFFLOAD_REQUIRE_MOONCAKE") == "1":
            raise RuntimeError(
                f"KVOFFLOAD_REQUIRE_MOONCAKE=1 but the Mooncake wheel does not import: {exc}"
            ) from exc
        pytest.skip(
            f"Mooncake Store's wheel does not import ({exc}); pip install "
            "'kvoffload[mooncake]' and apt-get install libibverbs1",
            allow_module_level=True,
        )
