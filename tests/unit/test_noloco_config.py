"""`NoLoCoConfig` validators, per-form outer momentum defaults and `cfg_hash`.

The inner LR schedule and optimizer are tested in tests/unit/test_inner_optim.py."""

import pytest
from pydantic import ValidationError

from node.config import load_config
from optimizers.config import DEFAULT_OUTER_MOMENTUM, HASHED_FIELDS, InnerConfig, NoLoCoConfig
from optimizers.diloco import DEFAULT_MOMENTUM


# ---- config ---------------------------------------------------------------------------------
def test_defaults_are_the_demo_column():
    cfg = NoLoCoConfig()
    assert (cfg.outer, cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum, cfg.consensus,
            cfg.group_size) == ("noloco", 20, 0.7, 0.5, "tied", 2)
    assert cfg.pairing == "seeded" and cfg.max_round_skew == 2 and cfg.max_solo_rounds == 3
    assert (cfg.inner.warmup, cfg.inner.total_steps, cfg.inner.min_lr_ratio) == (50, 2000, 0.1)
    assert cfg.inner.weight_decay == 0.0 and cfg.inner.clip_norm == 1.0
    assert cfg.inner.betas == (0.9, 0.999)
    assert cfg.gamma == 0.7 and not cfg.exchanges_phi


def test_every_field_is_documented():
    for model in (NoLoCoConfig, InnerConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_extra_keys_rejected():
    with pytest.raises(ValidationError, match="extra"):
        NoLoCoConfig(outer_learning_rate=0.7)
    with pytest.raises(ValidationError, match="extra"):
        NoLoCoConfig(inner={"learning_rate": 1e-3})


def test_group_size_one_with_noloco_rejected_with_fix():
    with pytest.raises(ValidationError, match="group_size=2"):
        NoLoCoConfig(group_size=1)
    NoLoCoConfig(group_size="all")
    NoLoCoConfig(group_size=4)


def test_consensus_float_with_diloco_rejected():
    with pytest.raises(ValidationError, match="remove consensus"):
        NoLoCoConfig(outer="diloco", consensus=0.5)
    cfg = NoLoCoConfig(outer="diloco", diloco_momentum="nesterov", outer_momentum=0.9)
    assert not cfg.exchanges_phi
    with pytest.raises(ValidationError, match="every live worker"):
        NoLoCoConfig(outer="diloco", group_size=2)
    NoLoCoConfig(outer="diloco", group_size="all")


def test_numeric_validators():
    with pytest.raises(ValidationError):
        NoLoCoConfig(inner_steps=0)
    with pytest.raises(ValidationError):
        NoLoCoConfig(outer_momentum=1.0)
    with pytest.raises(ValidationError):
        NoLoCoConfig(outer_lr=0)
    with pytest.raises(ValidationError, match=r"\[0, 2\)"):
        NoLoCoConfig(consensus=-0.1)
    with pytest.raises(ValidationError, match="tied"):
        NoLoCoConfig(consensus="loose")
    with pytest.raises(ValidationError, match="diverge"):
        NoLoCoConfig(outer_lr=2.5)
    with pytest.raises(ValidationError, match="total_steps"):
        NoLoCoConfig(inner={"warmup": 100, "total_steps": 50})
    with pytest.raises(ValidationError, match="betas"):
        NoLoCoConfig(inner={"betas": (0.9, 1.0)})
    with pytest.raises(ValidationError, match="round_timeout"):
        NoLoCoConfig(pairing="matchmaking", matchmaking_time=5, jitter_s=5, round_timeout=8)
    assert NoLoCoConfig(consensus="0.3").consensus == 0.3
    assert NoLoCoConfig(consensus=0).gamma == 0.0


def test_cfg_hash_stable_and_sensitive():
    base = NoLoCoConfig()
    h = base.cfg_hash()
    assert len(h) == 12 and all(c in "0123456789abcdef" for c in h)
    assert h == "b2e4b254641a"                                     # pinned: peers must agree
    assert NoLoCoConfig(outer_lr=0.7, inner_steps=20).cfg_hash() == h
    assert NoLoCoConfig.model_validate({"outer_lr": "0.7"}).cfg_hash() == h
    # knobs that need not match between peers do not change it
    assert NoLoCoConfig(round_timeout=30, checkpoint_every=3, inner={"lr": 1e-3}).cfg_hash() == h
    changed = {"outer": "diloco", "diloco_momentum": "nesterov", "inner_steps": 50,
               "outer_lr": 0.8, "outer_momentum": 0.3, "consensus": 0.7, "group_size": 4,
               "seed": 1}
    assert set(changed) == set(HASHED_FIELDS)
    seen = {h}
    for key, value in changed.items():
        other = NoLoCoConfig(**{key: value}).cfg_hash()
        assert other not in seen, key
        seen.add(other)


# ---- per-form outer momentum defaults --------------------------------------------------------
@pytest.mark.parametrize("section, expected", [
    ({}, 0.5),                                                        # NoLoCo alpha
    ({"outer": "diloco"}, 0.3),                                       # heavy-ball DiLoCo mu
    ({"outer": "diloco", "diloco_momentum": "heavyball"}, 0.3),
    ({"outer": "diloco", "diloco_momentum": "nesterov"}, 0.9),        # the DiLoCo paper
])
def test_each_form_gets_its_momentum_default_when_unset(section, expected):
    cfg = NoLoCoConfig.model_validate(section)
    assert cfg.outer_momentum == expected
    assert "default" in cfg.outer_momentum_note and f"={expected:g}" in cfg.outer_momentum_note


@pytest.mark.parametrize("section", [
    {"outer": "diloco", "outer_momentum": 0.5},
    {"outer": "diloco", "diloco_momentum": "nesterov", "outer_momentum": 0.3},
    {"outer": "noloco", "outer_momentum": 0.9},
    {"outer": "diloco", "outer_momentum": 0.0},                       # falsy, still explicit
])
def test_explicit_momentum_wins(section):
    cfg = NoLoCoConfig.model_validate(section)
    assert cfg.outer_momentum == section["outer_momentum"]
    assert "set in config" in cfg.outer_momentum_note


def test_momentum_default_through_toml_and_set_overrides(tmp_path):
    """The path a real node takes: a TOML file, then --set overrides, then the role's model."""
    from optimizers.noloco_role import NoLoCoRole

    toml = tmp_path / "node.toml"
    toml.write_text('role = "noloco"\n[noloco]\nouter = "diloco"\ndiloco_momentum = "nesterov"\n')
    s = NoLoCoRole.validate_config(load_config(toml, {}, environ={}))
    assert s.noloco.outer_momentum == 0.9
    s = NoLoCoRole.validate_config(load_config(toml, {"noloco": {"outer_momentum": 0.6}}, environ={}))
    assert s.noloco.outer_momentum == 0.6
    toml.write_text('role = "noloco"\n[noloco]\nouter = "diloco"\nouter_momentum = 0.5\n')
    assert NoLoCoRole.validate_config(load_config(toml, {}, environ={})).noloco.outer_momentum == 0.5


def test_hash_digests_the_effective_momentum():
    # a peer that writes the form's default explicitly must still match one that leaves it unset
    assert (NoLoCoConfig(outer="diloco").cfg_hash()
            == NoLoCoConfig(outer="diloco", outer_momentum=0.3).cfg_hash())
    assert (NoLoCoConfig(outer="diloco").cfg_hash()
            != NoLoCoConfig(outer="diloco", outer_momentum=0.5).cfg_hash())


def test_defaults_table_agrees_with_the_diloco_module():
    assert {k: DEFAULT_OUTER_MOMENTUM[k] for k in DEFAULT_MOMENTUM} == DEFAULT_MOMENTUM


def test_momentum_note_names_value_and_origin():
    assert (NoLoCoConfig(outer="diloco", diloco_momentum="nesterov").outer_momentum_note
            == "outer_momentum=0.9 (the Nesterov DiLoCo default)")
    assert (NoLoCoConfig(outer_momentum=0.4).outer_momentum_note
            == "outer_momentum=0.4 (set in config, NoLoCo)")
