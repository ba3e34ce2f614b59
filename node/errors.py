"""The error every config and usage mistake raises, below every module that checks settings.

``node/config.py`` exports it with the config it checks; modules the config itself imports
(``node/device.py``: a GPU asked for but not usable) raise it from here, so neither imports the
other.
"""

from __future__ import annotations


class ConfigError(Exception):
    """A config or usage mistake; the message names the field and the fix. Exit code 2."""

    exit_code = 2
