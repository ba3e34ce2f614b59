"""One outer exchange of a 64 MiB fp32 model between two workers on 127.0.0.1: ours vs hivemind.

(a) **ours**: `optimizers.exchange.OuterExchange.pair_average` (roster through signed records on
    real hivemind DHTs, tensors over the shared tensor stream as `NoLoCo.Exchange`, registered
    with `add_exchange_to_server`, default `poll_interval_s` 0.25 as the role uses);
    set up exactly as tests/integration/test_exchange.py does.
(b) **hivemind**: `hivemind.averaging.DecentralizedAverager(target_group_size=2,
    min_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5)`, the same tensors,
    no compression.

Each side is two spawned worker processes (one per "worker", each with its own DHT; hivemind
forks its DHT/averager processes from there), so no two workers share a GIL. The parent
orchestrates: both processes of a kind wait on a shared barrier, then start the exchange at
once; the time of one exchange = the slower of the two workers' wall time from the barrier to
having the mean. After one warm-up exchange per kind, repeats ALTERNATE ours / hivemind so
machine load hits both alike; the medians are kept.

Timed quantities (seconds, medians):
* `ours.total_s`: `pair_average` from call to return (roster publish/read, matching,
  streaming, mean); `ours.exchange_s`: the streaming part as `ExchangeResult.exchange_s`
  reports it.
* `hivemind.total_s`: `averager.step(timeout=...)` from call to return (includes matchmaking,
  whose floor is about `min_matchmaking_time`); `hivemind.allreduce_s`: separate repeats with
  `step(wait=False, require_trigger=True)`: once both controls reach AWAITING_TRIGGER, a
  barrier, then `allow_allreduce()` to `result()`: the all-reduce alone.
The headline `speedup_total = hivemind.total_s / ours.total_s` compares what each method needs
for one complete exchange; `speedup_transfer = hivemind.allreduce_s / ours.exchange_s` compares
the data-moving parts only. Means are checked against (a + b) / 2.

    python benchmarks/exchange_speed.py --quick --out /tmp/exchange_speed.json   # ~1-2 min
    python benchmarks/exchange_speed.py --out /tmp/exchange_speed.json           # 7 repeats
From code: ``from benchmarks.exchange_speed import run_exchange_bench; run_exchange_bench(True)``.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
RUN = "xbench"
CFG = "bench"
N_TENSORS, TENSOR_MIB = 16, 4           # 16 x 4 MiB = 64 MiB fp32
BARRIER_S = 120.0


def _tensors(seed: int, n: int, numel: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g, dtype=torch.float32) for _ in range(n)]


@functools.cache
def _expected_head(n: int, numel: int, k: int = 64):
    """(a + b) / 2 of the first k elements of every tensor, for the correctness check."""
    import torch
    a, b = _tensors(1, n, numel), _tensors(2, n, numel)
    return [((x[:k] + y[:k]) / 2) for x, y in zip(a, b)], torch


def _check(mean, n: int, numel: int) -> bool:
    exp, torch = _expected_head(n, numel)
    return all(torch.allclose(m.reshape(-1)[:64], e, rtol=1e-6, atol=1e-6) for m, e in zip(mean, exp))


# ------------------------------------------------------------------------------- ours

def _ours_worker(idx: int, boot, cmd_q, out_q, barrier, tmpdir: str, n: int, numel: int,
                 timeout: float, threads: int) -> None:
    try:
        import asyncio

        import grpc
        import hivemind
        import torch

        from optimizers.exchange import OuterExchange, add_exchange_to_server
        from optimizers.roster import ROSTER_NAMESPACE
        from protocol.grpc_options import server_options
        from security.keys import generate_key, peer_id_str, write_key_file
        from security.records import SignedRecordValidator

        torch.set_num_threads(threads)
        key = generate_key()
        path = write_key_file(Path(tmpdir) / f"ours{idx}.key", key)
        peers = [] if idx == 0 else boot.get(timeout=60)
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers,
                           identity_path=str(path),
                           record_validators=[SignedRecordValidator(RUN, key, [ROSTER_NAMESPACE])],
                           check_if_identity_free=False, start=True)
        if idx == 0:
            boot.put([str(m) for m in dht.get_visible_maddrs()])
        tensors = _tensors(idx + 1, n, numel)
        specs = [(f"t{i}", torch.float32, (numel,)) for i in range(n)]

        async def main() -> None:
            server = grpc.aio.server(options=server_options())
            port = server.add_insecure_port("127.0.0.1:0")
            ex = OuterExchange(run_id=RUN, peer_id=peer_id_str(key), cfg_hash=CFG,
                               grpc_addr=f"127.0.0.1:{port}", dht=dht, specs=specs)
            add_exchange_to_server(ex.servicer(), server)
            await server.start()
            out_q.put(("ready", idx, None))
            try:
                while True:
                    cmd = await asyncio.to_thread(cmd_q.get)
                    if cmd[0] == "stop":
                        break
                    rnd = cmd[1]
                    await asyncio.to_thread(barrier.wait, BARRIER_S)
                    t0 = time.perf_counter()
                    res = await ex.pair_average(rnd, tensors, timeout)
                    dt = time.perf_counter() - t0
                    ok = res.outcome == "ok" and res.mean is not None and _check(res.mean, n, numel)
                    out_q.put(("result", idx, {
                        "total_s": dt, "exchange_s": res.exchange_s, "blocked_s": res.blocked_s,
                        "outcome": res.outcome, "reason": res.reason, "n": res.n,
                        "sent_bytes": res.sent_bytes, "received_bytes": res.received_bytes,
                        "mean_ok": ok}))
            finally:
                await ex.close()
                await server.stop(0)

        asyncio.run(main())
        dht.shutdown()
    except Exception:  # noqa: BLE001 - report to the parent, which fails the benchmark
        out_q.put(("error", idx, traceback.format_exc()))


# ------------------------------------------------------------------------------- hivemind

def _hm_worker(idx: int, boot, cmd_q, out_q, barrier, n: int, numel: int, timeout: float,
               mm_time: float, req_timeout: float, threads: int) -> None:
    try:
        import hivemind
        import torch
        from hivemind.averaging import DecentralizedAverager
        from hivemind.averaging.control import AveragingStage

        mp.set_start_method("fork", force=True)  # hivemind forks its averager (spawn can't pickle it)
        torch.set_num_threads(threads)
        peers = [] if idx == 0 else boot.get(timeout=60)
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, start=True)
        if idx == 0:
            boot.put([str(m) for m in dht.get_visible_maddrs()])
        avg = DecentralizedAverager(
            averaged_tensors=_tensors(idx + 1, n, numel), dht=dht, prefix="xbench_pair",
            target_group_size=2, min_group_size=2, min_matchmaking_time=mm_time,
            request_timeout=req_timeout, start=True)
        out_q.put(("ready", idx, None))
        checked = False
        while True:
            cmd = cmd_q.get()
            if cmd[0] == "stop":
                break
            mode = cmd[2]
            if mode == "total":
                barrier.wait(BARRIER_S)
                t0 = time.perf_counter()
                gathered = avg.step(timeout=timeout)
                dt = time.perf_counter() - t0
                rec: dict[str, Any] = {"total_s": dt, "group_size": len(gathered or {})}
            else:  # "allreduce": matchmaking first, then time the triggered all-reduce alone
                barrier.wait(BARRIER_S)
                t0 = time.perf_counter()
                ctl = avg.step(wait=False, require_trigger=True, timeout=timeout)
                while ctl.stage != AveragingStage.AWAITING_TRIGGER and not ctl.done():
                    time.sleep(0.002)
                t_mm = time.perf_counter() - t0
                barrier.wait(BARRIER_S)
                t1 = time.perf_counter()
                ctl.allow_allreduce()
                gathered = ctl.result()
                rec = {"allreduce_s": time.perf_counter() - t1, "matchmaking_s": t_mm,
                       "group_size": len(gathered or {})}
            ok = None
            if not checked:  # the first exchange averages the originals: check the mean
                with avg.get_tensors() as ts:
                    ok = _check([t.clone() for t in ts], n, numel)
                checked = True
            rec["mean_ok"] = ok
            out_q.put(("result", idx, rec))
        avg.shutdown()
        dht.shutdown()
    except Exception:  # noqa: BLE001
        out_q.put(("error", idx, traceback.format_exc()))


# ------------------------------------------------------------------------------- parent

class _Pair:
    """Two worker processes of one kind, driven by commands; results collected per command."""

    def __init__(self, ctx, target, args_fn):
        self.boot, self.out_q, self.barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
        self.cmd_qs = [ctx.Queue(), ctx.Queue()]
        self.procs = [ctx.Process(target=target, args=(i, self.boot, self.cmd_qs[i], self.out_q,
                                                       self.barrier, *args_fn(i)), daemon=False)
                      for i in range(2)]

    def launch(self) -> None:
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float = 240.0) -> None:
        self._collect("ready", timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            kind, idx, payload = self.out_q.get(timeout=max(1.0, deadline - time.monotonic()))
            if kind == "error":
                raise RuntimeError(f"worker {idx} failed:\n{payload}")
            if kind == what:
                got[idx] = payload
        return [got[0], got[1]]

    def run(self, cmd: tuple, timeout: float) -> list[dict[str, Any]]:
        for q in self.cmd_qs:
            q.put(cmd)
        return self._collect("result", timeout)

    def stop(self) -> None:
        for q in self.cmd_qs:
            try:
                q.put(("stop",))
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            if p._popen is None:  # never started
                continue
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


class ExchangeBench:
    """Two phases, so a caller can overlap the slow process start-up (imports, DHTs, servers)
    with other work: ``launch()`` returns at once; ``measure()`` waits until all four worker
    processes are ready, then runs the warm-up and the timed repeats and shuts them down.
    Do not run other CPU-heavy work during ``measure()``."""

    def __init__(self, quick: bool = True, repeats: int | None = None, n_tensors: int = N_TENSORS,
                 tensor_mib: float = TENSOR_MIB, timeout: float = 60.0, mm_time: float = 1.0,
                 req_timeout: float = 0.5, threads: int = 1, log=print) -> None:
        self.quick, self.repeats = quick, repeats or (3 if quick else 7)
        self.n_tensors, self.tensor_mib, self.timeout = n_tensors, tensor_mib, timeout
        self.mm_time, self.req_timeout, self.threads, self.log = mm_time, req_timeout, threads, log
        self.numel = int(tensor_mib * MiB) // 4
        self.nbytes = n_tensors * self.numel * 4
        self.ours = self.hm = None
        self.t_launch = None

    def launch(self) -> "ExchangeBench":
        ctx = mp.get_context("spawn")
        self.t_launch = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix="xbench_")
        n, numel, timeout, threads = self.n_tensors, self.numel, self.timeout, self.threads
        self.ours = _Pair(ctx, _ours_worker, lambda i: (tmp, n, numel, timeout, threads))
        self.hm = _Pair(ctx, _hm_worker, lambda i: (n, numel, timeout, self.mm_time,
                                                    self.req_timeout, threads))
        try:
            self.ours.launch()
            self.hm.launch()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for pair in (self.ours, self.hm):
            if pair is not None:
                pair.stop()

    def measure(self) -> dict[str, Any]:
        if self.ours is None:
            self.launch()
        try:
            return self._measure()
        finally:
            self.close()

    def _measure(self) -> dict[str, Any]:
        ours, hm, log, timeout, repeats = self.ours, self.hm, self.log, self.timeout, self.repeats
        n_tensors, nbytes, mm_time = self.n_tensors, self.nbytes, self.mm_time
        t_start = time.perf_counter()
        rows: dict[str, list[list[dict[str, Any]]]] = {"ours": [], "hm_total": [], "hm_allreduce": []}
        ours.wait_ready()
        hm.wait_ready()
        log(f"exchange bench: workers up {time.perf_counter() - self.t_launch:.1f}s after launch; "
            f"{nbytes / MiB:.0f} MiB fp32 in {n_tensors} tensors")
        rnd = 0
        warm_o = ours.run(("run", rnd, "pair"), timeout + 30)
        warm_h = hm.run(("run", rnd, "total"), timeout + 30)
        log(f"  warm-up: ours {max(r['total_s'] for r in warm_o):.2f}s "
            f"({warm_o[0]['outcome']}), hivemind {max(r['total_s'] for r in warm_h):.2f}s")
        for i in range(repeats):
            rnd += 1
            o = ours.run(("run", rnd, "pair"), timeout + 30)
            h = hm.run(("run", rnd, "total"), timeout + 30)
            a = hm.run(("run", rnd, "allreduce"), timeout + 30)
            rows["ours"].append(o)
            rows["hm_total"].append(h)
            rows["hm_allreduce"].append(a)
            log(f"  rep {i + 1}/{repeats}: ours total {max(r['total_s'] for r in o):.3f}s "
                f"(stream {max(r['exchange_s'] for r in o):.3f}s, {o[0]['outcome']}/"
                f"{o[1]['outcome']}); hivemind total {max(r['total_s'] for r in h):.3f}s, "
                f"all-reduce only {max(r['allreduce_s'] for r in a):.3f}s")

        ok_reps = [o for o in rows["ours"] if all(r["outcome"] == "ok" for r in o)]
        ours_total = [max(r["total_s"] for r in o) for o in ok_reps]
        ours_stream = [max(r["exchange_s"] for r in o) for o in ok_reps]
        hm_ok = [h for h in rows["hm_total"] if all(r["group_size"] == 2 for r in h)]
        hm_total = [max(r["total_s"] for r in h) for h in hm_ok]
        hm_ar_ok = [a for a in rows["hm_allreduce"] if all(r["group_size"] == 2 for r in a)]
        hm_ar = [max(r["allreduce_s"] for r in a) for a in hm_ar_ok]
        mean_ok_ours = all(r["mean_ok"] for o in rows["ours"] + [warm_o] for r in o
                           if r["outcome"] == "ok")
        mean_ok_hm = all(r["mean_ok"] for r in warm_h if r["mean_ok"] is not None)
        res_ours = {"total_s": _stats(ours_total) if ours_total else None,
                    "exchange_s": _stats(ours_stream) if ours_stream else None,
                    "ok_repeats": len(ok_reps), "repeats": repeats, "mean_correct": mean_ok_ours,
                    "outcomes": [[r["outcome"] + (f":{r['reason']}" if r["reason"] else "") for r in o]
                                 for o in rows["ours"]],
                    "sent_bytes_per_worker": ok_reps[0][0]["sent_bytes"] if ok_reps else None,
                    "warmup_total_s": max(r["total_s"] for r in warm_o)}
        res_hm = {"total_s": _stats(hm_total) if hm_total else None,
                  "allreduce_s": _stats(hm_ar) if hm_ar else None,
                  "matchmaking_s_before_trigger": _stats([max(r["matchmaking_s"] for r in a)
                                                          for a in hm_ar_ok]) if hm_ar_ok else None,
                  "ok_repeats": len(hm_ok), "repeats": repeats, "mean_correct": mean_ok_hm,
                  "warmup_total_s": max(r["total_s"] for r in warm_h)}
        med = lambda d, k: d[k]["median"] if d.get(k) else None  # noqa: E731
        o_t, o_s, h_t, h_a = med(res_ours, "total_s"), med(res_ours, "exchange_s"), \
            med(res_hm, "total_s"), med(res_hm, "allreduce_s")
        summary = {
            "exchange_speedup_vs_hivemind_averager": (h_t / o_t) if o_t and h_t else None,
            "ours_total_s": o_t, "hivemind_total_s": h_t,
            "ours_stream_s": o_s, "hivemind_allreduce_only_s": h_a,
            "speedup_transfer_only": (h_a / o_s) if o_s and h_a else None,
            "ours_effective_MBps": nbytes / 1e6 / o_t if o_t else None,
            "hivemind_effective_MBps": nbytes / 1e6 / h_t if h_t else None,
            "model_bytes": nbytes, "repeats": repeats,
            "means_correct": bool(mean_ok_ours and mean_ok_hm),
            "note": ("medians after one warm-up; total = one complete exchange incl. matchmaking "
                     "(ours: DHT roster + pairing; hivemind: min_matchmaking_time "
                     f"{mm_time}s); headline = hivemind total / ours total; measured on 127.0.0.1 "
                     "with no emulated latency/bandwidth"),
        }
        try:
            load = os.getloadavg()
        except OSError:
            load = None
        return {"benchmark": "exchange_speed", "summary": summary, "ours": res_ours,
                "hivemind": res_hm,
                "config": {"quick": self.quick, "n_tensors": n_tensors, "tensor_mib": self.tensor_mib,
                           "model_mib": nbytes / MiB, "timeout_s": timeout,
                           "hivemind_min_matchmaking_time": mm_time,
                           "hivemind_request_timeout": self.req_timeout, "ours_poll_interval_s": 0.25,
                           "torch_threads": self.threads, "loadavg": load, "cpus": os.cpu_count()},
                "wall_s": round(time.perf_counter() - t_start, 2),
                "startup_s": round(t_start - self.t_launch, 2)}


def run_exchange_bench(quick: bool = True, repeats: int | None = None, n_tensors: int = N_TENSORS,
                       tensor_mib: float = TENSOR_MIB, timeout: float = 60.0,
                       mm_time: float = 1.0, req_timeout: float = 0.5, threads: int = 1,
                       log=print) -> dict[str, Any]:
    """Run both exchanges; returns {"summary": {...}, "ours": ..., "hivemind": ..., "config"}."""
    return ExchangeBench(quick, repeats, n_tensors, tensor_mib, timeout, mm_time, req_timeout,
                         threads, log).measure()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--tensors", type=int, default=N_TENSORS)
    ap.add_argument("--tensor-mib", type=float, default=TENSOR_MIB)
    ap.add_argument("--mm-time", type=float, default=1.0, help="hivemind min_matchmaking_time")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = run_exchange_bench(args.quick, args.repeats, args.tensors, args.tensor_mib,
                             mm_time=args.mm_time, req_timeout=min(0.5, args.mm_time / 2),
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(res, indent=1, default=float)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps(res["summary"], indent=1))
    return 0 if res["summary"]["exchange_speedup_vs_hivemind_averager"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
