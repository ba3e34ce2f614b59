"""The installed swarmnode version (from package metadata; a source checkout says 0+unknown)."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("swarmnode")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    VERSION = "0+unknown"
