"""node/device.py: config, device resolution and its errors, precision, host<->device movement,
metrics/card details and the start-up order (no CUDA call before the DHT). CPU paths only; the
CUDA paths are in tests/integration/test_gpu_noloco.py (marked gpu); the noloco engine under a
placement (host or device outer state, staged sends) in tests/unit/test_noloco_engine.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from node import device as nd
from node.config import ConfigError
from node.device import (DeviceConfig, PinnedPool, autocast, device_details, grad_scaler, load_to_device,
                         outer_state_device, record_memory, resolve_device, to_device)
from node.metrics import REGISTRY

CPU = torch.device("cpu")


def _no_gpu(monkeypatch, visible: str | None = None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


# ---- config ------------------------------------------------------------------------------------
def test_defaults_and_forms():
    cfg = DeviceConfig()
    assert (cfg.device, cfg.precision) == ("auto", "fp32")
    for ok in ("cpu", "CUDA", "cuda:0", "cuda:12", " auto "):
        assert DeviceConfig(device=ok).device == ok.strip().lower()
    for bad in ("gpu", "cuda:", "cuda:-1", "mps:0", "cuda0"):
        with pytest.raises(ValidationError, match="auto.*cpu.*cuda:N"):
            DeviceConfig(device=bad)
    with pytest.raises(ValidationError):
        DeviceConfig(precision="fp8")
    with pytest.raises(ValidationError):
        DeviceConfig(dev="cpu")  # extra keys refused


def test_section_is_registered_in_the_node_config():
    from node.config import DaemonConfig

    cfg = DaemonConfig(device={"device": "cpu", "precision": "bf16"})
    assert cfg.device == DeviceConfig(device="cpu", precision="bf16")
    assert DaemonConfig().device.device == "auto"


def test_fields_have_docstrings():
    for name, field in DeviceConfig.model_fields.items():
        assert field.description and len(field.description) > 40, name


# ---- resolution --------------------------------------------------------------------------------
def test_cpu_never_asks_cuda(monkeypatch):
    def boom():
        raise AssertionError("device='cpu' must not call torch.cuda")
    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    assert resolve_device(DeviceConfig(device="cpu")) == CPU
    assert resolve_device(DeviceConfig(device="cpu", precision="bf16")) == CPU


def test_auto_falls_back_to_cpu_without_gpu(monkeypatch):
    _no_gpu(monkeypatch)
    assert resolve_device(DeviceConfig()) == CPU


def test_auto_takes_the_first_gpu_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    assert resolve_device(DeviceConfig()) == torch.device("cuda", 0)
    assert resolve_device(DeviceConfig(device="cuda:1")) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device.device='cuda:2'.*device_count=2"):
        resolve_device(DeviceConfig(device="cuda:2"))


def test_missing_gpu_is_a_config_error_naming_the_field_and_what_was_found(monkeypatch):
    _no_gpu(monkeypatch)
    with pytest.raises(ConfigError) as err:
        resolve_device(DeviceConfig(device="cuda"))
    msg = str(err.value)
    assert "device.device='cuda'" in msg
    assert "torch.cuda.is_available()=False" in msg and "device_count=0" in msg
    assert "CUDA_VISIBLE_DEVICES=(unset)" in msg and "--gpus all" in msg
    assert err.value.exit_code == 2


def test_missing_indexed_gpu_reports_visible_devices(monkeypatch):
    _no_gpu(monkeypatch, visible="")
    with pytest.raises(ConfigError, match=r"device.device='cuda:3'.*device_count=0.*CUDA_VISIBLE_DEVICES=,"):
        resolve_device(DeviceConfig(device="cuda:3"))


def test_real_torch_on_this_machine_gives_the_clear_error():
    """No monkeypatching: what an operator sees on a host without a usable GPU."""
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(ConfigError, match=r"is_available\(\)=False"):
        resolve_device(DeviceConfig(device="cuda:3"))


def test_fp16_needs_cuda(monkeypatch):
    _no_gpu(monkeypatch)
    with pytest.raises(ConfigError, match=r"device.precision=\"fp16\" needs a CUDA device.*bf16"):
        resolve_device(DeviceConfig(device="auto", precision="fp16"))


def test_cli_exits_2_with_the_message_not_a_traceback(tmp_path):
    """The error reaches the operator as a ConfigError (exit 2), the way the CLI reports config
    mistakes, whatever role later calls resolve_device."""
    code = textwrap.dedent("""
        import sys, torch
        torch.cuda.is_available = lambda: False
        from node.config import ConfigError
        from node.device import DeviceConfig, resolve_device
        try:
            resolve_device(DeviceConfig(device="cuda"))
        except ConfigError as e:
            print(e); sys.exit(e.exit_code)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "device.device='cuda'" in out.stdout and "Traceback" not in out.stderr


# ---- precision ---------------------------------------------------------------------------------
def test_fp32_autocast_is_a_noop():
    a = torch.randn(4, 4)
    with autocast(CPU, "fp32"):
        assert (a @ a).dtype == torch.float32
    assert grad_scaler(CPU, "fp32") is None and grad_scaler(CPU, "bf16") is None


def test_bf16_autocast_on_cpu_computes_in_bf16_and_keeps_fp32_weights():
    lin = torch.nn.Linear(8, 8)
    with autocast(CPU, "bf16"):
        out = lin(torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    assert lin.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="bf16 or fp32"):
        autocast(CPU, "fp16")


def _tiny():
    from models.config import ModelConfig
    from models.llama import build_model

    return build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16), 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inner_step_with_precision_trains_on_cpu(precision):
    from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step

    model = _tiny()
    params = list(model.parameters())
    cfg = InnerConfig(lr=3e-3, warmup=0, total_steps=10, clip_norm=1.0)
    opt = build_optimizer(params, cfg)
    sched = inner_lr_scheduler(opt, cfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    losses = [inner_step(model, (x, y), opt, sched, params, cfg.clip_norm, autocast=autocast(CPU, precision),
                         scaler=grad_scaler(CPU, precision)) for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 and p.grad is None for p in params)


def test_inner_step_bf16_differs_from_fp32_so_autocast_is_really_on():
    from models.llama import lm_loss

    model = _tiny()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = lm_loss(model(x), x).item()
        with autocast(CPU, "bf16"):
            half = lm_loss(model(x), x).item()
    assert half != full and half == pytest.approx(full, rel=2e-2)


def test_inner_step_with_a_scaler_unscales_before_clipping():
    """The fp16 path's bookkeeping, run on CPU with an enabled CPU GradScaler (torch allows it):
    the step must equal an unscaled step with the same clipping."""
    from models.optim import InnerConfig, build_optimizer, inner_lr_scheduler, inner_step

    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = _tiny()
        params = list(model.parameters())
        cfg = InnerConfig(lr=1e-2, warmup=0, total_steps=10, clip_norm=0.5)
        opt = build_optimizer(params, cfg)
        inner_step(model, (x, x), opt, inner_lr_scheduler(opt, cfg), params, cfg.clip_norm, scaler=scaler)
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- host <-> device ---------------------------------------------------------------------------
def test_pool_reuses_buffers_per_slot():
    pool = PinnedPool(pin=False)
    a = torch.randn(3, 4)
    h1 = pool.to_host("theta.0", a, copy=True)
    assert h1 is not a and torch.equal(h1, a) and h1.data_ptr() != a.data_ptr()
    b = torch.randn(3, 4)
    h2 = pool.to_host("theta.0", b, copy=True)
    assert h2 is h1 and torch.equal(h2, b)              # same buffer, new contents
    pool.to_host("theta.1", b, copy=True)                # another slot, another buffer
    pool.to_host("theta.0", b.to(torch.bfloat16), copy=True)  # another dtype, another buffer
    assert len(pool) == 3 and pool.allocations == 3
    assert pool.nbytes() == 12 * 4 + 12 * 4 + 12 * 2


def test_pool_returns_cpu_tensors_without_a_copy():
    pool = PinnedPool(pin=False)
    a = torch.randn(5, requires_grad=True)
    h = pool.to_host("x", a)
    assert h.data_ptr() == a.data_ptr() and not h.requires_grad and len(pool) == 0
    out = pool.to_host_all({"a": a, "b": torch.ones(2)}, copy=True)
    assert set(out) == {"a", "b"} and pool.allocations == 2
    again = pool.to_host_all({"a": a * 2, "b": torch.zeros(2)}, copy=True)
    assert again["a"] is out["a"] and torch.equal(again["b"], torch.zeros(2)) and pool.allocations == 2


def test_pool_pins_only_with_cuda():
    pool = PinnedPool()
    assert pool.pin is torch.cuda.is_available()
    buf = pool.buffer("x", (4,), torch.float32)
    assert buf.is_pinned() is torch.cuda.is_available()


def test_to_device_is_a_noop_when_already_there():
    t = torch.randn(3)
    assert to_device(t, CPU) is t
    half = to_device(t, CPU, torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_load_to_device_places_tensors_and_refuses_anything_else():
    host = {"w": torch.randn(2, 2), "b": torch.zeros(2)}
    out = load_to_device(host, CPU)
    assert out["w"] is host["w"] and set(out) == {"w", "b"}
    as32 = load_to_device({"w": torch.ones(2, dtype=torch.float64)}, CPU, torch.float32)
    assert as32["w"].dtype == torch.float32
    with pytest.raises(TypeError, match="'evil' is a dict, not a tensor"):
        load_to_device({"evil": {"__reduce__": 1}}, CPU)


def test_outer_state_placement():
    assert outer_state_device("device", CPU) == CPU
    assert outer_state_device("host", torch.device("cuda", 1)) == CPU
    assert outer_state_device("device", torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="device.*host"):
        outer_state_device("gpu", CPU)


def test_noloco_section_has_outer_state_device_outside_the_hash():
    from optimizers.config import HASHED_FIELDS, NoLoCoConfig

    assert NoLoCoConfig().outer_state_device == "device"
    assert NoLoCoConfig(outer_state_device="host").cfg_hash() == NoLoCoConfig().cfg_hash()
    assert "outer_state_device" not in HASHED_FIELDS
    with pytest.raises(ValidationError):
        NoLoCoConfig(outer_state_device="gpu")


def test_host_outer_state_steps_like_device_state():
    """phi/m built on the host from device params give the same outer step (CPU == CPU here;
    the CUDA comparison is in the gpu tests)."""
    from optimizers.noloco import NoLoCoOuter

    g = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    theta = [p + 0.1 * torch.randn(p.shape, generator=g) for p in params]
    where = outer_state_device("host", CPU)
    a = NoLoCoOuter([p.to(where) for p in params])
    b = NoLoCoOuter(params)
    assert all(t.dtype == torch.float32 and t.device == where for t in a.phi + a.m)
    for x, y in zip(a.outer_step(theta, theta, n=2), b.outer_step(theta, theta, n=2)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---- metrics and card --------------------------------------------------------------------------
def test_cpu_details_and_info_metric():
    details = device_details(CPU)
    assert details["device_kind"] == "cpu" and details["device_memory_bytes"] > 0
    assert REGISTRY.get_sample_value("swarmnode_device_info",
                                     {"device": "cpu", "name": "cpu", "capability": ""}) == 1
    from node.card import NodeCard  # the details fit a card (small scalars)
    assert NodeCard.model_fields["details"].annotation is not None
    record_memory(CPU)  # no-op off CUDA: the gauges stay unset (0)
    assert REGISTRY.get_sample_value("swarmnode_cuda_memory_peak_bytes") == 0


def test_metrics_declared_once_against_the_node_registry():
    names = {m.name for m in REGISTRY.collect()}
    assert {"swarmnode_device_info", "swarmnode_cuda_memory_allocated_bytes",
            "swarmnode_cuda_memory_peak_bytes"} <= names


# ---- start-up order ----------------------------------------------------------------------------
def test_import_and_config_touch_no_cuda():
    code = textwrap.dedent("""
        import sys
        from node.config import DaemonConfig
        DaemonConfig(device={"device": "cuda:1", "precision": "bf16"})
        assert "torch" not in sys.modules, "config validation imported torch"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_recorder_sees_cuda_probes():
    with nd.cuda_calls_recorded() as calls:
        resolve_device(DeviceConfig(device="auto"))
    assert "is_available" in calls
    with nd.cuda_calls_recorded() as calls:
        resolve_device(DeviceConfig(device="cpu"))
    assert calls == []
