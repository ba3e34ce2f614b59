"""The writer that ``test_checkpoint_crash.py`` kills: a fork server of checkpoint writers.

    python -m tests.integration.ckpt_writer STATE_DIR

Reads one line per writer from stdin (``fork``), forks a child and prints ``child PID``. The
child resumes from the newest usable checkpoint in STATE_DIR (``resumed K DIGEST``, or
``resumed 0 -`` when there is none), then writes checkpoints of one 8 MB tensor forever,
``node/checkpoint.py``'s own save, printing ``start K`` before each save and ``written K DIGEST``
after it. Checkpoint K holds ``base() + K``, so the test can rebuild the exact content a file
must have. The parent prints ``dead PID`` once the child is gone (the test SIGKILLs it by PID).
Forking keeps each writer's start to milliseconds: torch is imported once, by the parent, which
never runs a tensor operation itself.
"""

from __future__ import annotations

import os
import sys

import torch

from node.checkpoint import Checkpointer

FORMAT = "swarmnode-crashtest-v1"
CFG = "crash"
N = 2_000_000  # 8 MB of float32: a save takes tens of milliseconds, so most kills land inside one


class Part:
    def __init__(self, sd: dict):
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def base() -> torch.Tensor:
    """Whole numbers in float32: ``base() + K`` is exact however it was summed."""
    return torch.randint(-2 ** 20, 2 ** 20, (N,), generator=torch.Generator().manual_seed(0)).float()


def checkpointer(state_dir: str) -> Checkpointer:
    return Checkpointer(state_dir, FORMAT, CFG, keep=2)


def _say(line: str) -> None:
    """One whole line in one ``write`` (atomic on a pipe): ``print`` under ``PYTHONUNBUFFERED=1`` (as
    CI may set) writes the text and its newline in two calls, and a SIGKILL between them glued the
    parent's next line onto the child's (``start 471dead 16501``)."""
    os.write(1, (line + "\n").encode())


def writer(state_dir: str) -> None:
    ck = checkpointer(state_dir)
    state = ck.read(required=("model",))
    k = int(state["meta"]["k"]) if state else 0
    _say(f"resumed {k} {state['digest'] if state else '-'}")
    w = base() + k
    while True:
        k += 1
        w += 1.0
        _say(f"start {k}")
        ck.save({"model": Part({"w": w})}, {"k": k})
        _say(f"written {k} {ck.last_digest}")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    for line in sys.stdin:
        if line.strip() != "fork":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                writer(argv[0])
            finally:
                os._exit(1)
        _say(f"child {pid}")
        os.waitpid(pid, 0)
        _say(f"dead {pid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
