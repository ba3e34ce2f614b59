"""Security: node identity (``keys``), signed owner-bound DHT records (``records``), and, as they
land, peer authentication, input limits, rollout filters and update monitors (docs/security.md).

Submodules are imported explicitly (``from security.keys import ...``); this package imports
nothing itself, so ``security.keys`` stays free of hivemind and torch.
"""
