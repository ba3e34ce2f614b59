"""Verifiable tasks for GRPO: prompts seeded by (run, round), held-out split, local verifiers.

Owns docs/grpo.md, 'Tasks': every peer rebuilds the same prompts from (run, round) alone, so only
`prompt_id`s travel, and every reward is computed here from the completion text by the receiver
(never taken from a sender).

- `ArithTask` (built in): sums of 2-3 operands. Prompt ``"3+4+1:"``; reference completion
  ``"3+4=7,7+1=8=>8\\n"``; reward 1 iff the first integer after ``=>`` is the sum (trailing text
  ignored, like `<answer>`-tag parsers). Problems hashing into the held-out split never appear
  as training prompts.
- `RGymTask` (optional extra ``swarmnode[rgym]``): reasoning-gym datasets built offline with
  `reasoning_gym.create_dataset(name, size, seed)`; reward = `score_answer` on the
  ``<answer>...</answer>`` span.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from importlib.metadata import version

from rl.grpo_config import DEFAULT_RGYM_DATASETS, GRPOConfig

STOP = "\n"


def round_seed(run: str, round_: int, split: str = "train") -> int:
    """H(run, round, split) as a 63-bit seed: the same on every peer."""
    d = hashlib.sha256(f"swarmnode/grpo-prompts:{run}:{round_}:{split}".encode()).digest()
    return int.from_bytes(d[:8], "little") & (2**63 - 1)


def prompt_id(task_spec: str, seed: int, round_: int, index: int) -> bytes:
    """prompt_id = H(task spec, seed, round, index), 32 bytes."""
    return hashlib.sha256(f"{task_spec}|{seed}|{round_}|{index}".encode()).digest()


@dataclass(frozen=True)
class Prompt:
    prompt_id: bytes
    text: str
    answer: str                          # ground truth, never sent
    data: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class ArithTask:
    min_operands: int = 2
    max_operands: int = 3
    max_operand: int = 9
    heldout_every: int = 5               # H(problem) % heldout_every == 0: held out
    version: str = "arith-v1"

    @property
    def spec(self) -> str:
        return (f"{self.version}:{self.min_operands}-{self.max_operands}:{self.max_operand}:"
                f"{self.heldout_every}")

    def is_heldout(self, operands: tuple[int, ...]) -> bool:
        h = hashlib.sha256(("+".join(map(str, operands))).encode()).digest()
        return int.from_bytes(h[:4], "little") % self.heldout_every == 0

    def _draw(self, rng: random.Random, heldout: bool) -> tuple[int, ...]:
        for _ in range(10_000):
            k = rng.randint(self.min_operands, self.max_operands)
            ops = tuple(rng.randint(0, self.max_operand) for _ in range(k))
            if self.is_heldout(ops) == heldout:
                return ops
        raise RuntimeError("arith task: could not draw a problem in the requested split; "
                           "raise max_operand or heldout_every")

    def _prompt(self, ops: tuple[int, ...], pid: bytes) -> Prompt:
        return Prompt(pid, "+".join(map(str, ops)) + ":", str(sum(ops)), {"operands": ops})

    def prompts(self, run: str, round_: int, n: int) -> list[Prompt]:
        """This round's n training prompts (same on every peer)."""
        seed = round_seed(run, round_)
        rng = random.Random(seed)
        return [self._prompt(self._draw(rng, False), prompt_id(self.spec, seed, round_, i))
                for i in range(n)]

    def heldout(self, n: int, seed: int = 0) -> list[Prompt]:
        """n fixed held-out prompts (disjoint from every training prompt)."""
        rng = random.Random(round_seed(f"heldout:{seed}", 0, "heldout"))
        return [self._prompt(self._draw(rng, True), prompt_id(self.spec, seed, -1, i))
                for i in range(n)]

    @staticmethod
    def reference(prompt: Prompt) -> str:
        """The reference completion (steps, then ``=>answer``, then the stop character)."""
        ops = prompt.data["operands"]
        steps, acc = [], ops[0]
        for x in ops[1:]:
            steps.append(f"{acc}+{x}={acc + x}")
            acc += x
        return ",".join(steps) + f"=>{acc}" + STOP

    @staticmethod
    def reward(prompt: Prompt, completion: str) -> float:
        """1.0 iff the first integer after the first ``=>`` equals the answer, else 0.0."""
        m = re.search(r"=>\s*(-?\d+)", completion)
        return 1.0 if m is not None and int(m.group(1)) == int(prompt.answer) else 0.0


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _require_rgym():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("the 'rgym' task needs the reasoning-gym package: "
                          "pip install 'swarmnode[rgym]' (or pip install reasoning-gym), "
                          "or use the built-in 'arith' task") from None
    return reasoning_gym


@dataclass(frozen=True)
class RGymTask:
    """reasoning-gym datasets, rebuilt offline by every peer from (run, round)."""

    names: tuple[str, ...] = DEFAULT_RGYM_DATASETS

    @property
    def spec(self) -> str:
        _require_rgym()
        return f"rgym-{version('reasoning-gym')}:{','.join(self.names)}"

    def _entries(self, seed: int, n: int):
        rg = _require_rgym()
        rng = random.Random(seed)
        names = [self.names[rng.randrange(len(self.names))] for _ in range(n)]
        out = []
        for i, name in enumerate(names):
            ds = rg.create_dataset(name, size=1, seed=(seed + i) & 0x7FFFFFFF)
            out.append((name, ds, ds[0]))
        return out

    def _build(self, seed: int, round_: int, n: int) -> list[Prompt]:
        return [Prompt(prompt_id(self.spec, seed, round_, i),
                       e["question"] + "\nPut the final answer in <answer></answer>.\n",
                       str(e["answer"]), {"dataset": name, "entry": e, "ds": ds})
                for i, (name, ds, e) in enumerate(self._entries(seed, n))]

    def prompts(self, run: str, round_: int, n: int) -> list[Prompt]:
        return self._build(round_seed(run, round_), round_, n)

    def heldout(self, n: int, seed: int = 0) -> list[Prompt]:
        return self._build(round_seed(f"heldout:{seed}", 0, "heldout"), -1, n)

    @staticmethod
    def reference(prompt: Prompt) -> str:
        return f"<answer>{prompt.answer}</answer>" + STOP

    @staticmethod
    def reward(prompt: Prompt, completion: str) -> float:
        m = _ANSWER.search(completion)
        if m is None:
            return 0.0
        try:
            return float(prompt.data["ds"].score_answer(m.group(1).strip(), prompt.data["entry"]))
        except Exception:        # a verifier must never crash on peer-generated text
            return 0.0


def make_task(cfg: GRPOConfig) -> ArithTask | RGymTask:
    """The task ``[grpo]`` names (``task``, its operand ranges or reasoning-gym datasets)."""
    if cfg.task == "rgym":
        return RGymTask(tuple(cfg.rgym_datasets))
    return ArithTask(min_operands=cfg.min_operands, max_operands=cfg.max_operands,
                     max_operand=cfg.max_operand)
