"""NoLoCo and DiLoCo outer optimizers (pure torch/numpy) and, later, the `noloco` role.

- `optimizers.config`: `NoLoCoConfig` / `InnerConfig` (the `[noloco]` section, `cfg_hash`).
- `optimizers.noloco`: `NoLoCoOuter` (phi, m, outer step, exchange buffers).
- `optimizers.diloco`: `DiLoCoOuter` (heavy-ball and Nesterov baselines).
- `optimizers.grouping`: seeded grouping, remainder policy, roster hash.
- `optimizers.schedule`: inner LR warm-up + cosine.

Method modules never see a peer or a socket; the role glues them to the transport.
"""
