"""Pipeline-backdoor checks on a `stage` node's weights and outputs (docs/pipeline.md, 'Stage-integrity checks').

The threat: the node serving one intermediate stage adds a small, offline-learned task vector to
its own weights a little each step, outside the gradient path, so no single update looks large.
Three checks, each a pure function or a small stateful object over ``{name: tensor}`` dicts
(pure torch + hashlib; no transport, no pipeline code: the stage role, the coordinator and the
benchmarks call these and move the bytes):

1. **Replica consistency** (`commit_weights`, `sketch_seed`, `weight_sketch`, `compare_sketches`).
   After each step every replica publishes ``commit_t`` (sha256 of its fp32 weights in name order).
   Only once all commits of iteration t are out is the sketch seed known (a hash of the run, t and
   the sorted commits), so nobody can shape its weights to a sketch in advance. The sketch is a
   per-tensor CountSketch (each element goes to one of ``dims`` buckets with a random sign) plus the
   tensor's norm, in float64; replicas compare sketches with a relative tolerance that holds the
   ulp-level drift of non-bit-exact all-reduce but not an injected edit. Exact commits are compared
   only where averaging is bit-exact. A mismatch says *a replica* deviates, not which: attribute it
   with check 2 (the replica whose step does not replay) or check 3.
2. **Update-size monitor** (`adam_step_bound`, `replay_adamw`, `UpdateMonitor`). Per tensor, the
   largest per-element change must fit the optimizer's own step bound: AdamW moves an element by
   at most ``lr * c_t + lr * wd * |w|`` (``c_t`` from `adam_step_bound`, plus fp slack). When the
   step's gradient and the pre-step optimizer state are known (a replica holds the stage's averaged
   gradient; a one-replica stage commits its gradient and state for audits), the monitor also
   replays the step (`replay_adamw`) and tests the residual ``actual - replayed``: an edit outside
   the gradient path leaves a residual that keeps its direction from one iteration to the next
   (cosine near 1), where fp noise from another machine's kernels has none. Recovery iterations
   (CheckFree rebuild, copy from a replica, fresh optimizer) are exempt and restart the history.
3. **Spot-check recomputation** (`spot_check`, `SpotSampler`, `verify_commit`). A same-stage
   verifier (or anyone holding the committed weights) recomputes a sampled microbatch's output
   from the committed weights and compares it with what the stage sent (fp32, relative 1e-4).
   Catches a stage whose outputs do not come from the weights it claims.

Every check returns a `CheckResult`: ``ok``, and when not ok one `Flag` per finding naming the
check, the suspect, the tensor, the measured value and the limit. The caller reports flags to the
coordinator (``ReportAnomaly``) and counts them in ``swarmnode_security_flags_total{check}``
(node/integrity_metrics.py); the response (quarantine, re-plan, rebuild) is not decided here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

Weights = Mapping[str, Tensor]

CHECKS = ("replica_sketch", "replica_commit", "update_bound", "update_drift", "spot_check", "commit_mismatch",
          "nonfinite_output", "stage_replay")
"""Values of `Flag.check` (and of the ``check`` label of swarmnode_security_flags_total)."""

FP32_EPS = float(torch.finfo(torch.float32).eps)


@dataclass(frozen=True)
class Flag:
    """One finding: which check, against whom, on which tensor, and the number that crossed the limit."""

    check: str
    suspect: str
    iteration: int
    reason: str
    tensor: str | None = None
    value: float = float("nan")
    limit: float = float("nan")

    def as_dict(self) -> dict:
        return {"check": self.check, "suspect": self.suspect, "iteration": self.iteration, "reason": self.reason,
                "tensor": self.tensor, "value": self.value, "limit": self.limit}


@dataclass
class CheckResult:
    """The outcome of one check on one suspect at one iteration."""

    check: str
    suspect: str
    iteration: int
    flags: list[Flag] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.flags

    def flag(self, reason: str, tensor: str | None = None, value: float = float("nan"),
             limit: float = float("nan"), check: str | None = None) -> None:
        self.flags.append(Flag(check or self.check, self.suspect, self.iteration, reason, tensor, value, limit))

    def __repr__(self) -> str:
        state = "ok" if self.ok else "; ".join(f.reason for f in self.flags[:3])
        return f"CheckResult({self.check}, {self.suspect}, it={self.iteration}: {state})"


def _fp32(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.float32).contiguous()


# ============================================================ 1. replica commitments and sketches

def commit_weights(weights: Weights) -> str:
    """sha256 over (name, shape, fp32 little-endian bytes) of every tensor, in sorted name order.

    Two replicas have equal commits iff their weights are bitwise equal in fp32."""
    digest = hashlib.sha256(b"swarmnode/stage-commit/v1")
    for name in sorted(weights):
        t = _fp32(weights[name])
        digest.update(name.encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
        digest.update(t.numpy().astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def sketch_seed(run: str, iteration: int, commits: Iterable[str]) -> int:
    """Seed of iteration t's sketches: a hash of the run, t and every replica's commit (sorted).

    Known only once all commits are published, so a replica cannot fit its weights to it."""
    text = "\n".join([run, str(int(iteration)), *sorted(commits)])
    return int.from_bytes(hashlib.sha256(b"swarmnode/sketch-seed/v1\n" + text.encode()).digest()[:8], "little") \
        & (2**63 - 1)


@dataclass(frozen=True)
class Sketch:
    """Per tensor: the fp64 norm and a `dims`-bucket CountSketch of the fp32 weights."""

    seed: int
    dims: int
    norms: dict[str, float]
    buckets: dict[str, Tensor]

    def size_bytes(self) -> int:
        return sum(b.numel() * 8 + 8 for b in self.buckets.values())


def _hash_params(seed: int, name: str) -> tuple[int, int, int, int]:
    """(a, b, c, d): odd 63-bit multipliers a, c and offsets b, d for the multiply-shift hashes."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    a, b, c, d = (int.from_bytes(digest[8 * k:8 * k + 8], "little") >> 1 for k in range(4))
    return a | 1, b, c | 1, d


_ARANGE: dict[int, Tensor] = {}


def _positions(n: int) -> Tensor:
    if n not in _ARANGE:
        if len(_ARANGE) > 64:
            _ARANGE.clear()
        _ARANGE[n] = torch.arange(n, dtype=torch.int64)
    return _ARANGE[n]


def weight_sketch(weights: Weights, seed: int, dims: int = 64) -> Sketch:
    """CountSketch of each tensor, summed in fp64: with h = a*i + b mod 2^64 (multiply-shift hashing,
    a odd and b drawn per tensor from (seed, name)), element i goes to bucket h >> (64 - log2 dims)
    with the sign of the next bit. Linear: sketch(A) - sketch(B) = sketch(A - B), and for a seed
    unknown in advance its norm estimates ||A - B||, so a difference cannot hide in a few
    coordinates. `dims` must be a power of 2."""
    if dims < 2 or dims & (dims - 1):
        raise ValueError(f"dims={dims} must be a power of 2 (>= 2); 64 is the default")
    shift = 64 - (dims.bit_length() - 1)
    norms, buckets = {}, {}
    for name in sorted(weights):
        flat = _fp32(weights[name]).reshape(-1).double()
        a, b, _, _ = _hash_params(seed, name)
        h = _positions(flat.numel()) * a + b
        idx = (h >> shift) & (dims - 1)
        negative = ((h >> (shift - 1)) & 1).bool()
        norms[name] = float(flat.norm())
        buckets[name] = torch.zeros(dims, dtype=torch.float64).index_add_(0, idx, torch.where(negative, -flat, flat))
    return Sketch(seed, dims, norms, buckets)


def compare_sketches(suspect: str, iteration: int, mine: Sketch, theirs: Sketch, *, rtol: float = 1e-5,
                     atol: float = 1e-9) -> CheckResult:
    """Flag `suspect` (the replica that sent `theirs`) when any tensor's sketch or norm differs from
    ours by more than ``rtol * scale + atol`` (scale = the larger sketch norm / tensor norm).

    rtol 1e-5 is ~80 fp32 ulps of relative drift: honest replicas under non-bit-exact averaging stay
    well below it (tests: 200+ iterations); an injected edit of 1e-3 relative per step is 100x above.
    A flag here means the two replicas disagree; attribute it with the update monitor's replay."""
    result = CheckResult("replica_sketch", suspect, iteration)
    if (mine.seed, mine.dims) != (theirs.seed, theirs.dims):
        result.flag(f"sketch seed/dims {theirs.seed}/{theirs.dims} != expected {mine.seed}/{mine.dims}: "
                    "the replica sketched with a seed it chose itself")
        return result
    if mine.buckets.keys() != theirs.buckets.keys():
        missing = sorted(set(mine.buckets) ^ set(theirs.buckets))
        result.flag(f"tensor sets differ ({missing[:4]}): not the same stage schema")
        return result
    for name in mine.buckets:
        a, b = mine.buckets[name], theirs.buckets[name]
        scale = max(float(a.norm()), float(b.norm()))
        dist = float((a - b).norm())
        if dist > rtol * scale + atol:
            result.flag(f"{name}: sketch distance {dist:.3e} > {rtol:g} x {scale:.3e}", name, dist / max(scale, 1e-30),
                        rtol)
            continue
        na, nb = mine.norms[name], theirs.norms[name]
        if abs(na - nb) > rtol * max(na, nb) + atol:
            result.flag(f"{name}: norm {nb:.6e} vs {na:.6e}", name, abs(na - nb) / max(na, nb, 1e-30), rtol)
    return result


def compare_commits(suspect: str, iteration: int, mine: str, theirs: str) -> CheckResult:
    """Exact commit comparison: only meaningful where replica averaging is bit-exact."""
    result = CheckResult("replica_commit", suspect, iteration)
    if mine != theirs:
        result.flag(f"commit {theirs[:12]} != {mine[:12]} under bit-exact averaging")
    return result


# ============================================================ 2. update-size monitor

def adam_step_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat / (sqrt(v_hat) + eps)| Adam can produce at step `step` (1-based), any gradients.

    By Cauchy-Schwarz on m_t = (1-b1) sum b1^k g_{t-k} against v_t = (1-b2) sum b2^k g_{t-k}^2:
    |m_t| / sqrt(v_t) <= (1-b1)/sqrt(1-b2) * sqrt(sum_{k<t} (b1^2/b2)^k); the bias corrections
    multiply by sqrt(1-b2^t) / (1-b1^t). Equals 1 at t = 1 and tends to ~7.27 for 0.9/0.999
    (Kingma & Ba's 3.16 = (1-b1)/sqrt(1-b2) is the typical, not the worst, case)."""
    b1, b2 = betas
    if step < 1:
        raise ValueError(f"step={step}: Adam steps count from 1")
    r = b1 * b1 / b2
    if r >= 1:
        raise ValueError(f"betas={betas}: b1^2 >= b2 gives no finite Adam step bound; use e.g. (0.9, 0.999)")
    series = (1 - r**step) / (1 - r)
    return (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series) * math.sqrt(1 - b2**step) / (1 - b1**step)


@dataclass(frozen=True)
class AdamHparams:
    """The optimizer settings a monitor holds a stage to (the run's config, never the suspect's word)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


def replay_adamw(before: Weights, grads: Weights, state: Mapping[str, Mapping[str, Tensor]], lr: float,
                 hp: AdamHparams) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """One torch AdamW step on copies: (weights after, optimizer state after). `state[name]` holds
    ``step``, ``exp_avg`` and ``exp_avg_sq`` as torch keeps them (empty / missing = first step).
    Uses torch's own kernel, so an honest step replays bit-exactly on the same build and device;
    across machines the residual is a few ulps (covered by UpdateMonitor's floor)."""
    names = sorted(before)
    shapes = [before[n].shape for n in names]
    sizes = [before[n].numel() for n in names]
    param = torch.nn.Parameter(torch.cat([before[n].detach().reshape(-1) for n in names]))
    param.grad = torch.cat([grads[n].detach().reshape(-1).to(param.dtype) for n in names])
    opt = torch.optim.AdamW([param], lr=lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    # AdamW is elementwise, so one flat tensor steps bit-for-bit like the per-tensor parameters
    if all(state.get(n) for n in names):
        steps = {float(state[n]["step"]) for n in names}
        if len(steps) != 1:
            raise ValueError(f"optimizer state has different step counts {sorted(steps)}; replay per tensor group")
        first = state[names[0]]
        opt.state[param] = {"step": first["step"].detach().clone() if isinstance(first["step"], Tensor)
                            else first["step"],
                            "exp_avg": torch.cat([state[n]["exp_avg"].detach().reshape(-1) for n in names]),
                            "exp_avg_sq": torch.cat([state[n]["exp_avg_sq"].detach().reshape(-1) for n in names])}
    elif any(state.get(n) for n in names):
        raise ValueError("optimizer state covers only some tensors; a stage's state must be complete or empty")
    opt.step()
    st = opt.state[param]
    flat = {k: list(torch.split(st[k].detach(), sizes)) for k in ("exp_avg", "exp_avg_sq")}
    params = list(torch.split(param.detach(), sizes))
    after = {n: params[i].reshape(shapes[i]) for i, n in enumerate(names)}
    new_state = {n: {"step": st["step"].clone() if isinstance(st["step"], Tensor) else st["step"],
                     "exp_avg": flat["exp_avg"][i].reshape(shapes[i]),
                     "exp_avg_sq": flat["exp_avg_sq"][i].reshape(shapes[i])} for i, n in enumerate(names)}
    return after, new_state


def _cos(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return 0.0 if na == 0 or nb == 0 else float(a @ b) / (na * nb)


class UpdateMonitor:
    """Watches one suspect's successive weights (its own node every step, peers every audit).

    ``observe(iteration, before, after, lr, step=..., replayed=...)``:
    - **update_bound**: per tensor, ``max |after - before| / (lr * c_step + lr * wd * |before| + slack)``
      must be <= 1 (``c_step`` = `adam_step_bound`; slack = `ulps` fp32 ulps of |before|). Catches a
      double step, a wrong LR, or an edit too big to pass as one update.
    - **update_drift** (when `replayed`, the step replayed from the committed pre-step state and the
      step's gradient, is given): residual = after - replayed, whole stage flattened. A residual above
      the floor (`ulps` ulps of |replayed| per element) that points the same way as the previous one
      (cosine >= `cos_min`) for `patience` consecutive iterations is a persistent edit outside the
      gradient path. Honest steps replay bit-exactly on one build; other kernels leave a few ulps,
      below the floor or with no persistent direction.
    - ``exempt=True`` (recovery iterations: CheckFree rebuild, copy from a replica, fresh optimizer):
      nothing is tested and the drift history restarts.

    Tuning: a flag on an honest node after a hardware change means the replay runs other kernels:
    raise `ulps` (default 8); a slow edit that escapes means lower `patience` (default 3)."""

    def __init__(self, suspect: str, hp: AdamHparams = AdamHparams(), *, ulps: float = 8.0, cos_min: float = 0.5,
                 patience: int = 3, bound_slack: float = 1e-6):
        if patience < 1:
            raise ValueError(f"patience={patience} must be >= 1")
        self.suspect, self.hp, self.ulps, self.cos_min, self.patience = suspect, hp, ulps, cos_min, patience
        self.bound_slack = bound_slack
        self._last_residual: Tensor | None = None
        self._streak = 0
        self.last_cosine: float | None = None
        self.last_residual_norm = 0.0
        self.off_path = False
        """Whether the last observed step left a residual above the floor (attributes a replica
        mismatch: of two disagreeing replicas, the one whose own step does not replay)."""

    def reset(self) -> None:
        self._last_residual, self._streak, self.last_cosine, self.off_path = None, 0, None, False

    def observe(self, iteration: int, before: Weights, after: Weights, lr: float, *, step: int,
                replayed: Weights | None = None, exempt: bool = False) -> CheckResult:
        result = CheckResult("update_bound", self.suspect, iteration)
        self.off_path = False
        if exempt:
            self.reset()
            result.note = "recovery iteration: exempt"
            return result
        if before.keys() != after.keys():
            result.flag(f"tensor sets differ before/after the step ({sorted(set(before) ^ set(after))[:4]})")
            return result
        c = adam_step_bound(step, self.hp.betas)
        names = sorted(before)
        sizes = [before[n].numel() for n in names]
        w0 = torch.cat([_fp32(before[n]).reshape(-1) for n in names])
        w1 = torch.cat([_fp32(after[n]).reshape(-1) for n in names])
        absw0 = w0.abs()
        limit = absw0 * (lr * self.hp.weight_decay + self.ulps * FP32_EPS) + (lr * c + self.bound_slack * lr)
        ratio = (w1 - w0).abs_().div_(limit)
        worst = float(ratio.max()) if ratio.numel() else 0.0
        if not math.isfinite(worst) or worst > 1.0:
            for name, part, a, b in zip(names, torch.split(ratio, sizes), torch.split(w0, sizes), torch.split(w1, sizes)):
                r = float(part.max()) if part.numel() else 0.0
                if not math.isfinite(r) or r > 1.0:
                    result.flag(f"{name}: step {float((b - a).abs().max()):.3e} is {r:.2f}x AdamW's bound "
                                f"(lr {lr:g} x {c:.3f} + decay)", name, r, 1.0)
        if replayed is None:
            return result
        ref = torch.cat([_fp32(replayed[n]).reshape(-1) for n in names])
        res = w1 - ref
        floor = ref.abs().mul_(self.ulps * FP32_EPS).add_(1e-12)
        off_path = self.off_path = bool((res.abs() > floor).any())
        self.last_residual_norm = float(res.norm())
        if not off_path:
            self._last_residual, self._streak, self.last_cosine = None, 0, None
            return result
        cos = None if self._last_residual is None else _cos(res.double(), self._last_residual.double())
        self.last_cosine = cos
        self._streak = self._streak + 1 if cos is None or cos >= self.cos_min else 1
        self._last_residual = res
        if self._streak >= self.patience:
            norms = [float(part.norm()) for part in torch.split(res, sizes)]
            worst_name = names[max(range(len(names)), key=norms.__getitem__)]
            result.flag(f"weights moved off the replayed AdamW step for {self._streak} iterations in a persistent "
                        f"direction (cosine {cos if cos is not None else float('nan'):.3f} >= {self.cos_min}; residual "
                        f"norm {self.last_residual_norm:.3e}, mostly {worst_name}): an edit outside the gradient path",
                        worst_name, cos if cos is not None else float("nan"), self.cos_min, check="update_drift")
        return result


# ============================================================ 3. spot-check recomputation

def verify_commit(suspect: str, iteration: int, weights: Weights, commit: str) -> CheckResult:
    """Fetched weights must hash to the commit the suspect published for that iteration."""
    result = CheckResult("commit_mismatch", suspect, iteration)
    got = commit_weights(weights)
    if got != commit:
        result.flag(f"fetched weights hash to {got[:12]}, the published commit is {commit[:12]}")
    return result


def spot_check(suspect: str, iteration: int, forward: Callable[[Weights, Tensor], Tensor], weights: Weights,
               x: Tensor, claimed: Tensor, *, rtol: float = 1e-4, atol: float = 1e-6) -> CheckResult:
    """Recompute ``forward(weights, x)`` (fp32, no grad) and compare with the `claimed` output:
    flag when ``||y - claimed|| > rtol * ||y|| + atol * sqrt(numel)`` or a shape/finiteness mismatch.
    `forward` is the stage function with explicit weights (see `module_forward`); `weights` are the
    suspect's committed weights (the verifier's own when it is a same-stage replica that agrees)."""
    result = CheckResult("spot_check", suspect, iteration)
    with torch.no_grad():
        y = forward(weights, x).float()
    claimed = claimed.detach().float()
    if claimed.shape != y.shape:
        result.flag(f"claimed output shape {tuple(claimed.shape)} != recomputed {tuple(y.shape)}")
        return result
    if not bool(torch.isfinite(claimed).all()):
        result.flag("claimed output has non-finite values")
        return result
    err, scale = float((y - claimed).norm()), float(y.norm())
    limit = rtol * scale + atol * math.sqrt(y.numel())
    if err > limit:
        result.flag(f"claimed output differs from the recomputation by {err / max(scale, 1e-30):.3e} relative "
                    f"(limit {rtol:g})", None, err / max(scale, 1e-30), rtol)
    return result


def module_forward(module: torch.nn.Module) -> Callable[[Weights, Tensor], Tensor]:
    """`forward(weights, x)` for `spot_check`: `module` run with `weights` swapped in
    (torch.func.functional_call); the module's own parameters are left untouched."""
    def forward(weights: Weights, x: Tensor) -> Tensor:
        return torch.func.functional_call(module, dict(weights), (x,))
    return forward


class SpotSampler:
    """Which microbatches to spot-check: a keyed hash of (iteration, microbatch id) below `rate`.

    The key is the verifier's secret, so the stage cannot tell which outputs will be checked."""

    def __init__(self, rate: float, key: bytes):
        if not 0 <= rate <= 1:
            raise ValueError(f"spot rate {rate} must be in [0, 1]; the default is 0.02")
        self.rate, self.key = rate, key

    def chosen(self, iteration: int, microbatch: int | str) -> bool:
        h = hashlib.blake2b(f"{iteration}:{microbatch}".encode(), key=self.key[:64], digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.rate


__all__ = ["AdamHparams", "CHECKS", "CheckResult", "Flag", "Sketch", "SpotSampler", "UpdateMonitor",
           "adam_step_bound", "commit_weights", "compare_commits", "compare_sketches", "module_forward",
           "replay_adamw", "sketch_seed", "spot_check", "verify_commit", "weight_sketch"]
