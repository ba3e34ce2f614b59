#!/usr/bin/env bash
# Install swarmnode and its test dependencies into ./.venv, check the import-layer contracts
# (`lint-imports`), then run the whole test suite (unit + integration, including the multi-node
# tests marked `slow`).
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # skip the multi-process tests
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages the deploy/ tests run: prometheus (prometheus + promtool: rule checks and a live
# Prometheus scraping a local swarm) and tini (the image's init, started outside Docker). Installed
# when missing and this user can (CI runs as root on Debian); otherwise those tests skip and say so.
need=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || need+=(prometheus)
command -v tini >/dev/null || need+=(tini)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "scripts/test.sh: installing ${need[*]} (apt-get)"
    guard=""   # keep the package's service from starting (no init system here)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && guard=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    if [ -n "$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "scripts/test.sh: ${need[*]} missing and not installable here (needs root and apt-get):" \
         "the Prometheus, promtool and tini tests will be skipped" >&2
  fi
fi
if command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v tini >/dev/null; then
  export CI_REQUIRE_DEPLOY_TOOLS=1   # present now: those tests must run, never skip
fi
python3 -m venv .venv
# torch 2.13.0 CPU: the pinned range in pyproject admits it, so nothing bigger is pulled in.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c "import protocol"   # generates protocol/*_pb2.py from the .proto files
# Layer contracts ([tool.importlinter] in pyproject.toml): a broken one fails before any test runs.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
