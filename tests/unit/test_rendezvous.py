"""node/rendezvous.py without a DHT: key layout, entry-model checks, and the validator wiring."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from node.rendezvous import Rendezvous
from security.records import SignedRecordValidator


class StageRecord(BaseModel):  # the pipeline's shape: indexed by iteration
    model_config = ConfigDict(extra="forbid", strict=True)
    iteration: int = Field(ge=0)
    stage: int = Field(ge=0)


class NoIndex(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    note: str


STAGES = Rendezvous("stage/records/", StageRecord, index_field="iteration", max_payload_bytes=512, max_ttl_s=30)


def test_key_layout_and_bad_rounds():
    assert STAGES.key("run", 0) == "run/stage/records/0"
    assert STAGES.key("run", 41) == "run/stage/records/41"
    for bad in (-1, True, "3", 2.0):
        with pytest.raises(ValueError, match="iteration must be an int >= 0"):
            STAGES.key("run", bad)


def test_namespace_carries_the_caps_and_matches_round_keys_only():
    ns = STAGES.namespace
    assert (ns.name, ns.model, ns.max_payload_bytes, ns.max_ttl_s) == ("stage/records/", StageRecord, 512, 30)
    v = SignedRecordValidator("run", None, [ns])
    assert v.namespace_of(STAGES.key("run", 5)) is ns
    assert v.namespace_of("run/stage/records/") is None
    assert v.namespace_of("run/stage/records/5/x") is None
    assert v.namespace_of("other/stage/records/5") is None


def test_construction_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="ends in '/'"):
        Rendezvous("stage/records", StageRecord, index_field="iteration")
    with pytest.raises(ValueError, match="ends in '/'"):
        Rendezvous("/stage/", StageRecord, index_field="iteration")
    with pytest.raises(ValueError, match="int field 'round'"):
        Rendezvous("stage/records/", StageRecord)           # default index field is absent
    with pytest.raises(ValueError, match="int field 'iteration'"):
        Rendezvous("x/", NoIndex, index_field="iteration")
    with pytest.raises(ValueError, match="max_entries"):
        Rendezvous("stage/records/", StageRecord, index_field="iteration", max_entries=0)
