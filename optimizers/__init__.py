"""NoLoCo and DiLoCo outer optimizers (pure torch/numpy) and, later, the `noloco` role.

- `optimizers.config`: `NoLoCoConfig` (the `[noloco]` section, `cfg_hash`); its `inner` table is
  `models.optim.InnerConfig` (inner AdamW, LR warm-up + cosine, `inner_step`: models/optim.py).
- `optimizers.noloco`: `NoLoCoOuter` (phi, m, outer step, exchange buffers).
- `optimizers.diloco`: `DiLoCoOuter` (heavy-ball and Nesterov baselines).
- `optimizers.grouping`: seeded grouping, remainder policy, roster hash.

Method modules never see a peer or a socket; the role glues them to the transport.
"""
