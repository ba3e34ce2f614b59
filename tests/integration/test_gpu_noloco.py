"""NoLoCo on CUDA (issue 9): a pair trains on the GPU, the outer state is fp32 where
`outer_state_device` says, one outer step matches the CPU result (atol 1e-5, fp32), and the
pinned pool / load_to_device paths move tensors between host and device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from node.device import (DeviceConfig, PinnedPool, autocast, grad_scaler, load_to_device, outer_state_device,
                         record_memory, resolve_device)
from node.metrics import REGISTRY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CPU = torch.device("cpu")


def _model(device):
    from models.config import ModelConfig
    from models.llama import build_model

    return build_model(ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=32), 0).to(device)


def _train_pair(device, steps=5, precision="fp32", placement="device"):
    """Two workers from the same init, different data; H inner steps, then one exact pair
    exchange (in-memory group mean) and the NoLoCo outer step."""
    from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step
    from optimizers.noloco import NoLoCoOuter, copy_into

    cfg = InnerConfig(lr=3e-3, warmup=0, total_steps=100, clip_norm=1.0)
    workers = []
    for w in range(2):
        model = _model(device)
        params = list(model.parameters())
        opt = build_optimizer(params, cfg)
        where = outer_state_device(placement, device)
        outer = NoLoCoOuter([p.detach().to(where) for p in params])
        workers.append((model, params, opt, inner_lr_scheduler(opt, cfg), outer))
    for w, (model, params, opt, sched, _) in enumerate(workers):
        g = torch.Generator().manual_seed(100 + w)
        for _ in range(steps):
            x = torch.randint(0, 256, (4, 32), generator=g).to(device)
            inner_step(model, (x, x), opt, sched, params, cfg.clip_norm,
                       autocast=autocast(device, precision), scaler=grad_scaler(device, precision))
    pool = PinnedPool()
    sent = []
    for w, (_, params, _, _, outer) in enumerate(workers):
        where = outer.phi[0].device
        theta = [p.detach() for p in params]
        if where.type == "cpu":
            theta = list(pool.to_host_all({f"{w}.{i}": t for i, t in enumerate(theta)}, copy=True).values())
            theta = [t.clone() for t in theta]
        sent.append(theta)
    means = [torch.stack(col).mean(0) for col in zip(*sent)]
    phis = []
    for (model, params, _, _, outer), theta in zip(workers, sent):
        phi = outer.outer_step(theta, means, n=2)
        copy_into(params, phi)
        phis.append([p.detach().to(CPU) for p in phi])
    return workers, phis


def test_pair_trains_on_cuda_and_outer_state_is_fp32_on_the_device():
    dev = resolve_device(DeviceConfig(device="cuda"))
    workers, _ = _train_pair(dev)
    for model, params, opt, _, outer in workers:
        assert all(p.device == dev for p in params)
        assert all(s.device == dev for st in opt.state.values() for s in st.values() if torch.is_tensor(s)
                   and s.dim() > 0)
        assert all(t.dtype == torch.float32 and t.device == dev for t in outer.phi + outer.m)
    record_memory(dev)
    assert REGISTRY.get_sample_value("swarmnode_cuda_memory_peak_bytes") > 0


def test_host_outer_state_lives_on_the_cpu():
    dev = resolve_device(DeviceConfig(device="cuda"))
    workers, _ = _train_pair(dev, placement="host")
    for model, params, _, _, outer in workers:
        assert all(t.dtype == torch.float32 and t.device == CPU for t in outer.phi + outer.m)
        assert all(p.device == dev for p in params)


def test_one_outer_step_matches_the_cpu_result():
    """Same init, same inner updates (computed on the GPU), then the outer step on CUDA vs CPU."""
    from optimizers.noloco import NoLoCoOuter

    dev = resolve_device(DeviceConfig(device="cuda"))
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(64, 64, generator=g), torch.randn(64, generator=g)]
    thetas = [[p + 0.01 * torch.randn(p.shape, generator=g) for p in init] for _ in range(2)]
    means = [torch.stack(col).mean(0) for col in zip(*thetas[0:1], *thetas[1:2])]
    cpu_phi = NoLoCoOuter(init).outer_step(thetas[0], means, n=2)
    gpu = NoLoCoOuter([p.to(dev) for p in init])
    gpu_phi = gpu.outer_step([t.to(dev) for t in thetas[0]], [m.to(dev) for m in means], n=2)
    for a, b in zip(gpu_phi, cpu_phi):
        assert a.device == dev and a.dtype == torch.float32
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-5)
    # a whole trained pair: fp32 GPU vs CPU after H inner steps and one outer step
    _, gpu_phis = _train_pair(dev, steps=3)
    _, cpu_phis = _train_pair(CPU, steps=3)
    for a, b in zip(gpu_phis[0], cpu_phis[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # inner AdamW steps on different kernels


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_pair_trains(precision):
    dev = resolve_device(DeviceConfig(device="cuda", precision=precision))
    workers, phis = _train_pair(dev, precision=precision)
    assert all(torch.isfinite(t).all() for phi in phis for t in phi)
    assert all(p.dtype == torch.float32 for p in workers[0][1])


def test_pinned_pool_and_load_to_device_on_cuda():
    dev = resolve_device(DeviceConfig(device="cuda"))
    pool = PinnedPool()
    assert pool.pin
    t = torch.randn(1000, device=dev)
    h = pool.to_host("x", t)
    assert h.is_pinned() and h.device == CPU and torch.equal(h, t.cpu())
    h2 = pool.to_host("x", t * 2)
    assert h2.data_ptr() == h.data_ptr() and pool.allocations == 1
    back = load_to_device({"x": h2}, dev)
    assert back["x"].device == dev and torch.equal(back["x"], t * 2)
    on_dev = load_to_device({"y": t}, dev)
    assert on_dev["y"] is t  # already there: no copy


@pytest.mark.parametrize("placement", ["device", "host"])
def test_engine_outer_step_on_cuda_matches_the_cpu_engine(placement):
    """The noloco engine placed the way the role places it: the tensors to send come back in
    pinned host buffers, phi/m live where ``outer_state_device`` says, the good state is a host
    copy, and one outer step gives the CPU engine's phi (fp32, atol 1e-5)."""
    from functools import partial

    from models.config import ModelConfig
    from optimizers.config import NoLoCoConfig
    from optimizers.noloco_engine import NoLoCoEngine, Placement

    dev = resolve_device(DeviceConfig(device="cuda"))
    cfg = NoLoCoConfig(outer_state_device=placement)
    engines = []
    for device in (CPU, dev):
        eng = NoLoCoEngine(cfg, ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=32))
        pool = PinnedPool(pin=device.type == "cuda")
        eng.place(Placement(device, outer_state_device(placement, device), autocast=partial(autocast, device, "fp32"),
                            to_host=partial(pool.to_host_all, copy=True)))
        eng.mark_good()
        with torch.no_grad():
            for p in eng.params:
                p.add_(0.01)
        sent = eng.outgoing()
        assert all(t.device == CPU and t.dtype == torch.float32 for t in sent)
        assert all(t.is_pinned() for t in sent) == (device.type == "cuda")
        assert eng.outer_step([s + 0.001 for s in sent], 2, sent, rnd=0).refused is None
        engines.append(eng)
    cpu, gpu = engines
    for a, b in zip(cpu.outer.phi, gpu.outer.phi):
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-5)
    where = outer_state_device(placement, dev)
    assert all(t.device == where and t.dtype == torch.float32 for t in gpu.outer.phi + gpu.outer.m)
    assert all(p.device == dev for p in gpu.params)
    assert all(t.device == CPU for t in gpu.good.phi.values()) and gpu.round == 1
