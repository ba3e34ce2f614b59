"""Grafana dashboards for swarmnode, generated from code into ``deploy/grafana/dashboards/*.json``.

    python deploy/dashboards.py            # rewrite the JSON files (commit them)
    python deploy/dashboards.py --check    # exit 1 when a committed file differs from the code

Built with Grafana's own ``grafana-foundation-sdk`` (the ``test`` extra pins it). One panel is one
line in :data:`DASHBOARDS`: ``ts(title, unit, description, (expr, legend), ...)``. Per-node
series are filtered through :data:`NODE` (a join on ``swarmnode_node_info``, the only series with
``run`` and ``peer_id``), swarm series from the bootstrap's ``/metrics/swarm`` through
:data:`SWARM` (they carry ``run`` and ``role`` themselves). Every dashboard has the variables
``$run``, ``$role`` and ``$instance`` (a role dashboard's ``$role`` starts at its role), a fixed
``uid``, the datasource by uid ``prometheus`` (provisioned in ``deploy/grafana/provisioning``)
and ``$__rate_interval`` in rates.

``tests/unit/test_observability_config.py`` checks the JSON against this code and every metric
name against a node's real registry; ``tests/integration/test_observability.py`` runs every
panel's PromQL on a Prometheus scraping a local swarm. Standard library + the SDK only: no
swarmnode import, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueGraphMode, LegendDisplayMode, LegendPlacement,
                                                  TooltipDisplayMode)
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, GridPos, VariableOption, VariableRefresh,
                                                     VariableSort)

OUT = Path(__file__).resolve().parent / "grafana" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")

NODE = 'on(job, instance) group_left(run, role) swarmnode_node_info{run=~"$run", role=~"$role", instance=~"$instance"}'
"""Multiply a per-node series by this: keeps the nodes of the chosen run/role/instance, adds run and role."""
RUN = 'on(job, instance) group_left(run) swarmnode_node_info{run=~"$run"}'
"""The same for coordinator series that live on the bootstrap (no role filter)."""
SWARM = 'run=~"$run", role=~"$role"'
"""Label matchers for the swarm view (``/metrics/swarm``), whose series carry run and role."""
RATE = "$__rate_interval"

PENDING_METRICS: dict[str, str] = {}
"""Series the specs name whose code has not landed in this tree yet. Panels and rules use them
already; the tests assert each one is still missing from a node's registry (so this list shrinks
as the roles land: remove a name once it is declared) and skip only the panels made of them."""


@dataclass(frozen=True)
class Panel:
    kind: str                         # timeseries | stat | table
    title: str
    unit: str
    description: str
    targets: tuple[tuple[str, str], ...]   # (PromQL, legend)
    width: int = 12
    height: int = 8


def ts(title: str, unit: str, description: str, *targets: tuple[str, str], width: int = 12) -> Panel:
    return Panel("timeseries", title, unit, description, targets, width)


def stat_(title: str, unit: str, description: str, *targets: tuple[str, str]) -> Panel:
    return Panel("stat", title, unit, description, targets, width=6, height=4)


def table_(title: str, unit: str, description: str, *targets: tuple[str, str]) -> Panel:
    return Panel("table", title, unit, description, targets, width=24, height=8)


def p95(metric: str, sel: str = NODE, q: float = 0.95) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}]) * {sel}))"


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    role: str | None = None           # default of $role on a role dashboard
    tags: tuple[str, ...] = field(default=("swarmnode",))


DASHBOARDS: dict[str, Dashboard] = {
    "swarm": Dashboard("swarmnode-swarm", "swarmnode / Swarm", "The whole run: nodes by role and state from the "
                       "bootstrap's card view, joins and leaves, reachability, rejected input.", (
        stat_("Ready nodes", "short", "READY node cards in the run (bootstrap's view; includes nodes Prometheus "
              "cannot reach).", (f'sum(max by (role) (swarmnode_swarm_nodes{{{SWARM}, state="ready"}}))', "ready")),
        stat_("Joining nodes", "short", "Nodes still JOINING: stuck ones say why on /readyz and in `swarmnode status`.",
              (f'sum(max by (role) (swarmnode_swarm_nodes{{{SWARM}, state="joining"}}))', "joining")),
        stat_("Unreachable nodes", "short", "Nodes no event-bus peer could dial (BUS_REACH 0/N in `swarmnode status`): "
              "open eventbus.port or set eventbus.announce_addrs.",
              (f"sum(max by (role) (swarmnode_swarm_unreachable_nodes{{{SWARM}}}))", "unreachable")),
        stat_("Scrape targets down", "short", "Targets Prometheus could not scrape at the last attempt.",
              ('sum(1 - up{job=~"swarmnode|swarmnode_swarm", instance=~"$instance"})', "down")),
        ts("Nodes by role and state", "short", "Live node cards by role and lifecycle state (bootstrap's view, "
           "/metrics/swarm).", (f"max by (role, state) (swarmnode_swarm_nodes{{{SWARM}}}) > 0", "{{role}} {{state}}")),
        ts("Joins and leaves", "short", "Peer IDs appearing and disappearing in the run's cards per interval; "
           "'vanished' = the card expired without a drain (crash or unannounced preemption).",
           (f"max by (role) (increase(swarmnode_swarm_joins_total{{{SWARM}}}[{RATE}]))", "{{role}} joined"),
           (f"max by (role, how) (increase(swarmnode_swarm_leaves_total{{{SWARM}}}[{RATE}]))", "{{role}} left ({{how}})")),
        ts("Scraped nodes by state", "short", "Nodes Prometheus scrapes, by their own lifecycle state. Fewer than the "
           "card view: nodes behind NAT; more: nodes that do not see the bootstrap's DHT (a split swarm).",
           (f"sum by (role, state) (swarmnode_state * {NODE}) > 0", "{{role}} {{state}}")),
        ts("Progress by role (card view)", "short", "Highest and lowest round / iteration on the run's cards: a "
           "widening gap means laggards.",
           (f'max by (role, detail) (swarmnode_swarm_card_detail{{{SWARM}, detail=~"round|iteration"}})',
            "{{role}} {{detail}} max"),
           (f'min by (role, detail) (swarmnode_swarm_card_detail{{{SWARM}, detail=~"round|iteration"}})',
            "{{role}} {{detail}} min")),
        ts("DHT peers per node", "short", "Routing-table size of each node; 0 for long means the node lost the "
           "swarm (it re-bootstraps: readiness reason dht_no_peers).", (f"swarmnode_dht_peers * {NODE}", "{{instance}}")),
        ts("Event-bus peers reached", "short", "Peers whose gossip address this node could dial at the last probe "
           "(0 when the bus is off).", (f"swarmnode_eventbus_reachable_peers * {NODE}", "{{instance}}")),
        ts("Scrape targets up", "short", "1 = Prometheus scraped the target at the last attempt.",
           ('up{job=~"swarmnode|swarmnode_swarm", instance=~"$instance"}', "{{job}} {{instance}}")),
        ts("Card-view age", "s", "Seconds since the bootstrap last read the run's cards; above a minute its DHT is "
           "in trouble (alert SwarmnodeCensusStale).",
           ('time() - max by (run) (swarmnode_swarm_census_timestamp_seconds{run=~"$run"})', "{{run}}")),
        ts("Rejected requests by reason", "reqps", "gRPC requests refused before handling (auth, stale, size, rate, "
           "schema, ...); a steady rate from one peer ends in a ban.",
           (f"sum by (reason) (rate(swarmnode_rpc_rejected_total[{RATE}]) * {NODE})", "{{reason}}")),
        ts("Rejected tensors by reason", "ops", "Received tensors refused (checksum, shape, dtype, size, nonfinite, "
           "norm, ...).", (f"sum by (reason) (rate(swarmnode_tensors_rejected_total[{RATE}]) * {NODE})", "{{reason}}")),
        ts("Peers banned", "short", "Peers or IPs each node bans right now for repeated rejected calls.",
           (f"swarmnode_peers_banned * {NODE}", "{{instance}}")),
        table_("Nodes (card view)", "short", "One row per live node card: peer ID, role, state, version.",
               (f"max by (peer_id, role, state, version) (swarmnode_swarm_card_info{{{SWARM}}})", "")),
    )),
    "noloco": Dashboard("swarmnode-noloco", "swarmnode / NoLoCo", "NoLoCo and DiLoCo workers: loss, outer rounds "
                        "by outcome, time blocked on the group, exchange traffic.", (
        ts("Train loss", "none", "Training loss of each worker's latest inner step.",
           (f"swarmnode_train_loss * {NODE}", "{{instance}}")),
        ts("Eval loss", "none", "Validation loss of each worker's weights at its latest evaluation (noloco.eval_every).",
           (f"swarmnode_eval_loss * {NODE}", "{{instance}}")),
        ts("Outer round", "short", "Round label of each worker; one far behind the others is a laggard.",
           (f"swarmnode_outer_round * {NODE}", "{{instance}}")),
        ts("Outer rounds by outcome", "short", "Outer steps per minute, all workers: ok (averaged with a group), "
           "solo (no partner came), failed (rolled back).",
           (f"60 * sum by (outcome) (rate(swarmnode_outer_rounds_total[{RATE}]) * {NODE})", "{{outcome}}")),
        ts("Time blocked on the group", "percentunit", "Share of wall time each worker waits for its group in the "
           "outer exchange (alert above 50 %).",
           (f"rate(swarmnode_outer_blocked_seconds_sum[{RATE}]) * {NODE}", "{{instance}}")),
        ts("Blocked per round", "s", "Seconds a round waits for its group, p50 and p95 over all workers.",
           (p95("swarmnode_outer_blocked_seconds", q=0.5), "p50"), (p95("swarmnode_outer_blocked_seconds"), "p95")),
        ts("Outer exchange traffic", "Bps", "Bytes per second each worker sends and receives in outer exchanges.",
           (f"rate(swarmnode_outer_sent_bytes_total[{RATE}]) * {NODE}", "{{instance}} sent"),
           (f"rate(swarmnode_outer_received_bytes_total[{RATE}]) * {NODE}", "{{instance}} received")),
        ts("Group size", "short", "Mean group size of the outer steps (1 = solo).",
           (f"(rate(swarmnode_outer_group_size_sum[{RATE}]) / rate(swarmnode_outer_group_size_count[{RATE}])) * {NODE}",
            "{{instance}}")),
        ts("Partner repeat ratio", "percentunit", "Share of recent rounds with the same partners as the round before "
           "(high: the random pairing is stuck).", (f"swarmnode_outer_partner_repeat_ratio * {NODE}", "{{instance}}")),
        ts("Replica spread", "none", "RMS distance per parameter between a worker's weights and its group mean.",
           (f"swarmnode_replica_spread * {NODE}", "{{instance}}")),
        ts("Training throughput", "short", "Tokens per second each worker trains on.",
           (f"rate(swarmnode_train_tokens_total[{RATE}]) * {NODE}", "{{instance}}")),
    ), role="noloco"),
    "pipeline": Dashboard("swarmnode-pipeline", "swarmnode / Pipeline", "SkipPipe stages: iterations, iteration and "
                          "idle time, microbatches in flight, CheckFree recoveries, quarantined replicas.", (
        ts("Iteration", "short", "Optimizer steps each stage node has taken.",
           (f"swarmnode_pipeline_iteration * {NODE}", "{{instance}}")),
        ts("Stage served", "short", "Pipeline stage index each node serves.",
           (f"swarmnode_pipeline_stage_index * {NODE}", "{{instance}}")),
        ts("Iteration time", "s", "Wall seconds per pipeline iteration, p50 and p95 over all stage nodes.",
           (p95("swarmnode_pipeline_iteration_seconds", q=0.5), "p50"), (p95("swarmnode_pipeline_iteration_seconds"), "p95")),
        ts("Idle time", "percentunit", "Share of wall time each node waited for a message while an iteration was "
           "open (rate of idle seconds), and the idle share of its latest iteration.",
           (f"rate(swarmnode_pipeline_idle_seconds_total[{RATE}]) * {NODE}", "{{instance}}"),
           (f"swarmnode_pipeline_idle_fraction * {NODE}", "{{instance}} last iteration")),
        ts("Microbatches in flight", "short", "Microbatches each node holds for their backward pass.",
           (f"swarmnode_pipeline_in_flight * {NODE}", "{{instance}}")),
        ts("Microbatches", "ops", "Microbatch computes per second, all stage nodes, by direction.",
           (f"sum by (direction) (rate(swarmnode_pipeline_microbatches_total[{RATE}]) * {NODE})", "{{direction}}")),
        ts("Deferred forwards", "ops", "Forwards deferred for lack of a memory slot (schedule.memory).",
           (f"rate(swarmnode_pipeline_deferred_total[{RATE}]) * {NODE}", "{{instance}}")),
        ts("Train loss", "none", "Loss reported by the stage nodes that compute it (the last stage).",
           (f"swarmnode_train_loss * {NODE}", "{{instance}}")),
        ts("CheckFree recoveries", "short", "Stages rebuilt from their neighbours per interval, by rule; and the p95 "
           "time a recovery took.",
           (f"sum by (rule) (increase(swarmnode_checkfree_recoveries_total[{RATE}]) * {NODE})", "{{rule}}"),
           (p95("swarmnode_checkfree_recovery_duration_seconds"), "p95 duration (s)")),
        ts("Stage-0 copy age", "short", "Iterations since each stage-1 node last refreshed its copy of stage 0 "
           "(embedding, head): what a stage-0 rebuild would roll back. Above stage.checkfree.embed_copy_every, "
           "its refreshes fail (see embed_copy_failed in its log).",
           (f"(swarmnode_pipeline_iteration - swarmnode_checkfree_embed_copy_iteration) * {NODE} "
            "and on(job, instance) swarmnode_checkfree_embed_copy_iteration >= 0", "{{instance}}")),
        ts("Quarantined replicas and flags", "short", "Replicas the coordinator leaves out of the schedule until they "
           "resync from their stage's majority, and stage-integrity flags per interval by check.",
           (f"max by (run) (swarmnode_pipeline_quarantined_replicas * {RUN})", "quarantined"),
           (f"sum by (check) (increase(swarmnode_security_flags_total[{RATE}]) * {RUN})", "flag {{check}}")),
    ), role="stage"),
    "grpo": Dashboard("swarmnode-grpo", "swarmnode / GRPO", "Collaborative GRPO peers: reward, accuracy, accepted "
                      "and rejected rollouts, rounds, F-TIS.", (
        ts("Reward", "none", "Mean reward of each peer's own completions in its latest round.",
           (f"swarmnode_grpo_reward * {NODE}", "{{instance}}")),
        ts("Held-out accuracy", "percentunit", "Accuracy on fixed held-out prompts (grpo.eval_every).",
           (f"swarmnode_grpo_heldout_accuracy * {NODE}", "{{instance}}")),
        ts("Rollouts accepted", "short", "Completions used in GRPO steps per second, all peers, by source "
           "(local = own, peer = received and accepted).",
           (f"sum by (source) (rate(swarmnode_grpo_rollouts_total[{RATE}]) * {NODE})", "{{source}}")),
        ts("Rollouts rejected", "short", "Rollout batches or shards refused per second, all peers, by reason "
           "(logit_check, judge, schema, stale, quota, digest).",
           (f"sum by (reason) (rate(swarmnode_grpo_rollouts_rejected_total[{RATE}]) * {NODE})", "{{reason}}")),
        ts("Rounds by outcome", "short", "GRPO rounds per minute, all peers: ok (with peers' rollouts), solo, skipped.",
           (f"60 * sum by (outcome) (rate(swarmnode_grpo_rounds_total[{RATE}]) * {NODE})", "{{outcome}}")),
        ts("Round duration", "s", "Seconds from a round's start to the end of its step, p50 and p95.",
           (p95("swarmnode_grpo_round_duration_seconds", q=0.5), "p50"), (p95("swarmnode_grpo_round_duration_seconds"), "p95")),
        ts("Peers seen per round", "short", "Peers whose valid batch arrived for each peer's last round.",
           (f"swarmnode_grpo_peers_seen * {NODE}", "{{instance}}")),
        ts("F-TIS filtering", "percentunit", "Share of the last step's samples the KL filter dropped, and of foreign "
           "tokens whose importance ratio was truncated.",
           (f"swarmnode_grpo_ftis_filtered_fraction * {NODE}", "{{instance}} filtered"),
           (f"swarmnode_grpo_ftis_truncated_ratio * {NODE}", "{{instance}} truncated")),
        ts("Rollout traffic", "Bps", "Rollout payload bytes per second, all peers, by direction.",
           (f"sum by (direction) (rate(swarmnode_grpo_wire_bytes_total[{RATE}]) * {NODE})", "{{direction}}")),
        ts("Train loss", "none", "GRPO loss of each peer's latest step.", (f"swarmnode_train_loss * {NODE}", "{{instance}}")),
    ), role="grpo"),
}


# ---- building --------------------------------------------------------------------------------

def _variable(name: str, query: str, default: str | None) -> dash_b.QueryVariable:
    var = (dash_b.QueryVariable(name).label(name).query(query).datasource(DATASOURCE)
           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
           .multi(True).include_all(True).all_value(".*"))
    if default is not None:
        var = var.current(VariableOption(selected=True, text=[default], value=[default]))
    return var


def _panel(p: Panel, panel_id: int, pos: GridPos):
    if p.kind == "timeseries":
        b = (timeseries.Panel()
             .legend(common_b.VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_b.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)))
    elif p.kind == "stat":
        b = (stat.Panel().graph_mode(BigValueGraphMode.AREA)
             .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    else:
        b = table.Panel().show_header(True)
    b = b.id(panel_id).title(p.title).description(p.description).unit(p.unit).datasource(DATASOURCE).grid_pos(pos)
    for i, (expr, legend) in enumerate(p.targets):
        q = prometheus.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).datasource(DATASOURCE)
        if p.kind == "table":
            q = q.instant().format("table")
        else:
            q = q.range().legend_format(legend)
        b = b.with_target(q)
    return b


def build(d: Dashboard) -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    b = (dash_b.Dashboard(d.title).uid(d.uid).description(d.description).tags(list(d.tags))
         .editable().time("now-1h", "now").refresh("10s").timezone("browser")
         .annotation(dash_b.AnnotationQuery().name("Annotations & Alerts").type("dashboard")
                     .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                     .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)"))
         .with_variable(_variable("run", "label_values(swarmnode_node_info, run)", None))
         .with_variable(_variable("role", 'label_values(swarmnode_node_info{run=~"$run"}, role)', d.role))
         .with_variable(_variable("instance", 'label_values(swarmnode_node_info{run=~"$run", role=~"$role"}, instance)',
                                  None)))
    x = y = row_h = 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        b = b.with_panel(_panel(p, i, GridPos(h=p.height, w=p.width, x=x, y=y)))
        x, row_h = x + p.width, max(row_h, p.height)
    out = json.loads(json.dumps(b.build(), cls=JSONEncoder))
    out["id"] = None                  # provisioning assigns it; the uid is the stable name
    for var in out["templating"]["list"]:
        var.pop("id", None)           # the SDK's placeholder UUID (the same for every variable)
    return out


def render(d: Dashboard) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = ap.parse_args(argv)
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, d in DASHBOARDS.items():
        path, text = OUT / f"{name}.json", render(d)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    extra = sorted(p.name for p in OUT.glob("*.json") if p.stem not in DASHBOARDS)
    if args.check and (stale or extra):
        print(f"dashboards out of date: {stale + extra}; run `python deploy/dashboards.py` and commit the JSON",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
