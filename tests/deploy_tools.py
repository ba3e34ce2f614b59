"""Debian tools the deploy/ tests run (prometheus, promtool, tini): found, or a skip that says how
to get them. scripts/test.sh installs them in CI and sets CI_REQUIRE_DEPLOY_TOOLS=1, which turns
a missing tool into a failure, so those tests never skip silently there."""

from __future__ import annotations

import os
import shutil

import pytest


def deploy_tool(exe: str, package: str) -> str:
    """Path of ``exe`` (from the Debian package ``package``), else skip (fail under CI)."""
    path = shutil.which(exe)
    if path is None:
        if os.environ.get("CI_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail(f"{exe} is missing but CI_REQUIRE_DEPLOY_TOOLS=1 (scripts/test.sh installs {package})")
        pytest.skip(f"{exe} not installed (apt-get install {package}); scripts/test.sh installs it in CI")
    return path
