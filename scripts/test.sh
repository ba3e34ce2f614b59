#!/usr/bin/env bash
# Install swarmnode and its test dependencies into ./.venv, check the import-layer contracts
# (`lint-imports`), then run the whole test suite (unit + integration, including the multi-node
# tests marked `slow`).
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -m "not slow"   # skip the multi-process tests
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch 2.13.0 CPU: the pinned range in pyproject admits it, so nothing bigger is pulled in.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c "import protocol"   # generates protocol/*_pb2.py from the .proto files
# Layer contracts ([tool.importlinter] in pyproject.toml): a broken one fails before any test runs.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
