"""Compressed outer exchanges on real processes: a bootstrap and two ``noloco`` workers on
127.0.0.1 with ``noloco.compression = "topk"`` (NoLoCo pairs and DiLoCo groups).

The workers pair (or group) and train: validation loss falls; each averaged round's payload is
the compressed size the codec predicts for that round label (phi rounds carry phi in int8 on
top), far under the fp32 payload; the round log carries the bytes.
"""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from models.hf_adapter import build_from_config
from node.localswarm import LocalSwarm
from optimizers.config import NoLoCoConfig
from optimizers.outer_codec import OuterCodec
from tests.integration.test_noloco_swarm import events, metric, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
COMMON = [
    "noloco.inner_steps=8", "noloco.round_timeout=6", "noloco.eval_every=2", "noloco.eval_batches=4",
    "noloco.torch_threads=1", "noloco.checkpoint_every=0", "noloco.inner.lr=0.003", "noloco.inner.warmup=10",
    "noloco.compression=topk", "noloco.compression_topk=0.05", "noloco.compression_phi_every=2",
    *(f"model.{k}={v}" for k, v in MODEL.items()),
    "data.seq_len=64", "data.batch_size=8", "data.max_train_bytes=1000000", "data.max_val_bytes=100000",
    "card.ttl_s=10", "card.refresh_s=2",
]


def _codec(outer: str) -> tuple[OuterCodec, int]:
    """The codec the workers build, and the model's parameter count."""
    cfg = NoLoCoConfig(outer=outer, compression="topk", compression_topk=0.05, compression_phi_every=2)
    model = build_from_config(ModelConfig(**MODEL), seed=0)
    named = list(model.named_parameters())
    codec = OuterCodec.from_config(cfg, [n for n, _ in named], [tuple(p.shape) for _, p in named])
    return codec, sum(p.numel() for _, p in named)


@pytest.mark.parametrize("outer", ["noloco", "diloco"])
def test_compressed_workers_average_compressed_payloads_and_train(tmp_path, outer):
    codec, n_params = _codec(outer)
    with LocalSwarm(run_id=f"compressed-{outer}", workdir=tmp_path, common_set=[*COMMON, f"noloco.outer={outer}"]) as swarm:
        boot = swarm.start("bootstrap", name="bootstrap")
        swarm.wait_ready([boot], timeout=90)
        workers = [swarm.start("noloco", name=f"w{i}") for i in range(2)]
        swarm.wait_ready(workers, timeout=180)

        def ok_rounds(w):
            return [e for e in events(w, "averaging_round_done") if e["outcome"] == "ok"]
        def evals(w):
            return [e["eval_loss"] for e in events(w, "eval_done")]

        def learned(w):  # a worker that joined late starts from a trained state: it needs more rounds
            return bool(evals(w)) and min(evals(w)) < w.metrics()["swarmnode_eval_loss_initial"] - 0.05
        wait_for(lambda: all(len(ok_rounds(w)) >= 4 and learned(w) for w in workers), 300,
                 lambda: f"4 averaged rounds on each worker ({[len(ok_rounds(w)) for w in workers]}) and its eval "
                         f"loss 0.05 under its initial one ({[(w.name, evals(w)[-3:]) for w in workers]})")
        for w in workers:
            done = ok_rounds(w)
            # a pair side, or a DiLoCo member/root of 2: one payload out, one in, of the codec's size
            for e in done:
                assert e["sent_bytes"] == e["received_bytes"] == codec.payload_bytes(e["round"] - 1), e
            per_param = [e["sent_bytes"] / n_params for e in done]
            assert max(per_param) < (0.25 + 1.05 if outer == "noloco" else 0.3), per_param
            if outer == "noloco":  # phi every 2nd label: both kinds of payload occur
                assert len({e["sent_bytes"] for e in done}) == 2, per_param
            assert not metric(w, "swarmnode_tensors_rejected_total"), w.metrics()
            initial = w.metrics()["swarmnode_eval_loss_initial"]
            assert evals(w) and min(evals(w)) < initial - 0.05, (w.name, initial, evals(w))
