"""NoLoCo and DiLoCo: the outer optimizers (pure torch/numpy), the worker's engine and the `noloco` role.

- `optimizers.config`: `NoLoCoConfig` (the `[noloco]` section, `cfg_hash`); its `inner` table is
  `models.optim.InnerConfig` (inner AdamW, LR warm-up + cosine, `inner_step`: models/optim.py).
- `optimizers.noloco`: `NoLoCoOuter` (phi, m, outer step, exchange buffers).
- `optimizers.diloco`: `DiLoCoOuter` (heavy-ball and Nesterov baselines).
- `optimizers.outer_state`: tensor-list helpers both outer optimizers share (`copy_into`, ...).
- `optimizers.grouping`: seeded grouping, remainder policy, roster hash.
- `optimizers.waiting`: the waiting rules (how long to wait for a partner, when to stop).
- `optimizers.noloco_engine`: `NoLoCoEngine`, one worker's model, inner optimizer and phi/m (no network).
- `optimizers.noloco_role`: the `noloco` role (round policy on `node.training.TrainingRole`), its
  settings and card in `optimizers.noloco_settings`, the exchange in `optimizers.exchange*`.

Method modules never see a peer or a socket; the role glues them to the transport.
"""
