"""Poisoned-rollout defenses for a GRPO learner: glue between ``rl/learner.py`` and ``security/``.

Per round, in the order of docs/grpo.md, 'Defenses' (after signature, schema and caps):

1. ``admit`` (before mixing): a rate-banned sender's batches are dropped unopened; each sender's
   completions past its per-round token budget are dropped (both counted as ``quota``); only the
   ``per_sender_per_prompt`` completions per group the mix can use are charged to the budget
   (``grpo.topology = "vertical"``: whole groups, each charged and kept or dropped as one).
2. ``support_rows`` names the foreign rows that get the logit / support check (senders whose
   batch names our ``model_id`` under ``defense.kind = "auto"``); the learner computes their
   support statistics in its one re-scoring forward.
3. ``check`` (after re-scoring and the local rewards): same-model rows -> logit check
   (``logit_check``); other rows -> loose probability floor (``logit_check``), then the judge on
   the rows in its scope (``judge``). Every checked row feeds the sender's rejection rate; a
   sustained rate bans the sender (``on_ban``). Dropped rows leave the advantages and the loss.

Verdicts of the content checks never feed the transport's strike counter (docs/grpo.md, 'Defenses').
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from typing import Callable

import torch
from torch import Tensor

from node.logs import emit
from rl.grpo_config import GRPOConfig
from rl.rollout import PromptGroup, RolloutBatch
from security.judge import ArithJudge, CachedJudge, HFJudge
from security.rollout_filters import LogitCheckParams, floor_check, logit_check
from security.sender_policy import RejectionRatePolicy, TokenBudget

log = logging.getLogger("swarmnode.grpo")


def build_judge(cfg: GRPOConfig) -> CachedJudge:
    d = cfg.defense
    if d.judge == "hf":
        if not d.judge_hf_path:
            raise ValueError("grpo.defense.judge = 'hf' needs grpo.defense.judge_hf_path (a local Hugging Face "
                             "folder); or use judge = 'arith' for the built-in task")
        return CachedJudge(HFJudge(d.judge_hf_path, d.judge_margin, d.judge_max_completion_tokens,
                                   style=d.judge_style, max_new_tokens=d.judge_max_new_tokens))
    if cfg.task != "arith":
        raise ValueError("grpo.defense.judge = 'arith' only knows the built-in arith task; set "
                         "grpo.defense.judge = 'hf' with judge_hf_path for other tasks")
    return CachedJudge(ArithJudge())


class Defense:
    """See the module doc. ``on_reject(reason, n)``, ``on_ban(sender, reason)`` are callbacks
    (called on the learner's thread); ``decode`` turns token ids into text for the judge."""

    def __init__(self, cfg: GRPOConfig, model_id: str, decode: Callable[[list[int]], str],
                 on_reject: Callable[[str, int], None] = lambda reason, n: None,
                 on_ban: Callable[[str, str], None] = lambda sender, reason: None,
                 judge: CachedJudge | None = None, clock: Callable[[], float] | None = None,
                 on_judge: Callable[[str], None] = lambda outcome: None):
        d = self.dcfg = cfg.defense
        self.cfg, self.model_id, self.decode = cfg, model_id, decode
        self.kind = d.kind
        self.params = LogitCheckParams(cfg.temperature, cfg.top_k, cfg.top_p, d.support_slack, d.min_token_prob,
                                       d.eps_lp, d.support_min_tokens, d.min_token_weight)
        self._judge = judge
        self._on_reject, self._on_ban_cb, self._on_judge = on_reject, on_ban, on_judge
        kw = {"clock": clock} if clock is not None else {}
        self.policy = RejectionRatePolicy(window=d.ban_window, min_checked=min(d.ban_min_checked, d.ban_window),
                                          ban_rate=d.ban_rate, warn_rate=d.warn_rate, ban_s=d.ban_ttl_s,
                                          on_ban=self._banned, **kw)
        self.vertical = cfg.topology == "vertical"
        per_group = cfg.completions_per_prompt if self.vertical else cfg.per_sender_per_prompt
        budget = d.sender_token_budget or max(1, cfg.prompts_per_round * per_group * cfg.max_completion_tokens // 2)
        self.budget = TokenBudget(budget)
        self.rejected: Counter[str] = Counter()
        self.per_sender: dict[str, Counter] = defaultdict(Counter)   # checked, rejected, <reason>, quota
        self.ban_rounds: dict[str, int] = {}
        self._round = 0

    @property
    def judge(self) -> CachedJudge:
        if self._judge is None:
            self._judge = build_judge(self.cfg)
        return self._judge

    @property
    def judge_name(self) -> str:
        return self.judge.name

    def _banned(self, sender, reason: str) -> None:
        self.ban_rounds.setdefault(str(sender), self._round)
        emit(log, "grpo_sender_banned", "banned {sender} from this peer's rollouts for {ban_s:.0f} s: {reason}",
             level=logging.WARNING, sender=str(sender), ban_s=self.dcfg.ban_ttl_s, reason=reason, round=self._round)
        self._on_ban_cb(str(sender), reason)

    def _reject(self, sender: str, reason: str, n: int = 1) -> None:
        self.rejected[reason] += n
        self.per_sender[sender][reason] += n
        self._on_reject(reason, n)

    # ---- 1. admission ----
    def admit(self, round_: int, batches: list[RolloutBatch]) -> list[RolloutBatch]:
        self._round = round_
        out = []
        pps = self.cfg.per_sender_per_prompt
        for b in batches:
            if self.kind != "off" and self.policy.is_banned(b.sender):
                self._reject(b.sender, "quota", sum(len(g.completions) for g in b.groups))
                continue
            groups, over = [], 0
            for g in b.groups:
                if self.vertical:                    # a generator's group is trained whole or not at all
                    if self.budget.take(round_, b.sender, sum(len(c.token_ids) for c in g.completions)):
                        groups.append(g)
                    else:
                        over += len(g.completions)
                    continue
                keep = []
                for c in g.completions[:pps]:
                    if self.budget.take(round_, b.sender, len(c.token_ids)):
                        keep.append(c)
                    else:
                        over += 1
                if keep:
                    groups.append(PromptGroup(g.prompt_id, keep))
            if over:
                self._reject(b.sender, "quota", over)
            if groups:
                out.append(RolloutBatch(b.run, b.round, b.sender, b.tokenizer_hash, b.temperature, groups,
                                        b.config_hash, b.model_id))
        return out

    # ---- 2. which rows get the logit check ----
    def uses_logit(self, model_id: str) -> bool:
        return self.kind == "logit" or (self.kind == "auto" and model_id == self.model_id)

    def support_rows(self, m) -> Tensor | None:
        if self.kind == "off":
            return None
        rows = torch.tensor([bool(f) and self.uses_logit(mid) for f, mid in zip(m.foreign.tolist(), m.model_ids)],
                            dtype=torch.bool)
        return rows if bool(rows.any()) else None

    # ---- 3. content checks ----
    def check(self, round_: int, m, lp: Tensor) -> tuple[Tensor, dict[str, int]]:
        """Dropped foreign rows [N] bool and counts by metrics reason."""
        N = len(m.rewards)
        dropped = torch.zeros(N, dtype=torch.bool)
        counts: Counter[str] = Counter()
        if self.kind == "off":
            return dropped, {}
        foreign = m.foreign.tolist()
        logit_verdict: dict[int, str | None] = {}
        if m.support is not None and m.support_rows is not None:
            idx = m.support_rows.nonzero().squeeze(1).tolist()
            dev = m.support.processed_logp.device
            verdicts = logit_check(m.support, m.gen_logp[idx].to(dev), m.mask[idx].to(dev), self.params)
            logit_verdict = dict(zip(idx, verdicts))
        other = [i for i in range(N) if foreign[i] and i not in logit_verdict]
        floor_ok = dict(zip(other, floor_check(lp[other].cpu(), m.mask[other], self.dcfg.min_token_prob_foreign))) \
            if other else {}
        for i in range(N):
            if not foreign[i]:
                continue
            sender = m.senders[i]
            reason = None
            if i in logit_verdict:
                detail = logit_verdict[i]
                if detail is not None:
                    reason = "logit_check"
                    self.per_sender[sender][detail] += 1
            elif not floor_ok[i]:
                reason, detail = "logit_check", "min_prob_foreign"
                self.per_sender[sender][detail] += 1
            else:
                if self.dcfg.judge_scope == "positive" and m.rewards[i] <= 0:
                    continue                      # not reinforced: not judged, not counted as checked
                ids = m.tokens[i][m.mask[i]].tolist()
                text = self.decode(ids)
                hits = self.judge.hits
                verdict = self.judge.verdict_cached(m.prompts[int(m.group[i])].prompt_id,
                                                    torch.tensor(ids, dtype=torch.int32).numpy().tobytes(),
                                                    m.prompts[int(m.group[i])].text, text)
                self._on_judge("cached" if self.judge.hits > hits else
                               (verdict if verdict in ("safe", "unparsed") else "unsafe"))
                if verdict in ("unsound", "unparsed"):
                    # unsound: the problem's own chain with a wrong step beside a right answer (weak honest
                    # models write these too); unparsed: the LLM judge gave no readable decision (fail
                    # closed). Neither is trained on; neither is blamed on the sender (no ban)
                    dropped[i] = True
                    counts["judge"] += 1
                    self.per_sender[sender]["checked"] += 1
                    self.per_sender[sender][verdict if verdict == "unsound" else "judge_unparsed"] += 1
                    self._reject(sender, "judge")
                    self.policy.record(sender, False)
                    continue
                reason = None if verdict == "safe" else "judge"
                if reason is not None:
                    self.per_sender[sender][f"judge_{verdict}"] += 1
            self.per_sender[sender]["checked"] += 1
            if reason is not None:
                dropped[i] = True
                counts[reason] += 1
                self.per_sender[sender]["rejected"] += 1
                self._reject(sender, reason)
            self.policy.record(sender, reason is not None, reason or "content")
        return dropped, dict(counts)

    def sender_report(self) -> dict[str, dict]:
        """Per sender: checked, rejected, rate, reasons, quota, banned (for logs, status and benchmarks)."""
        out = {}
        for s, c in self.per_sender.items():
            checked = c.get("checked", 0)
            out[s] = {**dict(c), "rate": round(c.get("rejected", 0) / checked, 4) if checked else 0.0,
                      "banned": self.policy.is_banned(s), "ban_round": self.ban_rounds.get(s)}
        return out
