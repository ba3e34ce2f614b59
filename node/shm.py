"""Shared-memory check at start: hivemind moves tensors between its processes through /dev/shm.

Docker gives a container 64 MiB of /dev/shm unless ``--shm-size`` says otherwise, which is far
too small once averaging starts; the failure then shows up late and far from its cause (a bus
error or an averager timeout). :func:`shm_warning` says so at start, with the flag to pass.
"""

from __future__ import annotations

import logging
import os

from node.logs import emit

log = logging.getLogger("swarmnode.shm")

MIN_SHM_BYTES = 1 << 30
"""Below this much /dev/shm the node warns (the embedded demo model needs far less; real models
want about 4x their fp32 size)."""


def shm_warning(path: str = "/dev/shm") -> str:
    """A sentence naming the ``--shm-size`` to pass when ``path`` is small; "" when it is fine or absent."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    size = st.f_frsize * st.f_blocks
    if size >= MIN_SHM_BYTES:
        return ""
    return (f"{path} holds only {size / 2**20:.0f} MiB; hivemind moves tensors through it and averaging will fail "
            "with a bus error or time out. Start the container with --shm-size=2g (about 4x the model's fp32 size "
            "for large models; compose: shm_size)")


def warn_if_small() -> None:
    text = shm_warning()
    if text:
        emit(log, "shm_too_small", "{detail}", level=logging.WARNING, detail=text)
