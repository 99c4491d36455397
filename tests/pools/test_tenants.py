"""pools.tenants: the `tenants:` section's `share_files` key, and the one rule for who owns the files and
batches a request creates (`Tenants.owner`) and what a tenant created before owners existed
(`Tenants.legacy_owner`)."""

from __future__ import annotations

import hashlib

import pytest

from pools.tenants import DEFAULT_OWNER, DEFAULT_TENANT, Tenants, parse_tenants
from pools.config.checks import SpecError


def _key_owner(api_key: str) -> str:
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()


def _make_tenants() -> Tenants:
    return Tenants(parse_tenants({"team": {"api_keys": ["sk-t1", "sk-t2"], "share_files": True},
                                  "solo": {"api_keys": ["sk-s"]}, "pair": {"api_keys": ["sk-p1", "sk-p2"]},
                                  "nightly": {"weight": 2}}))


def test_share_files_is_parsed_and_checked():
    specs = parse_tenants({"team": {"api_keys": ["sk-1"], "share_files": True}, "solo": {"api_keys": ["sk-2"]}})
    assert specs["team"].share_files is True and specs["solo"].share_files is False
    for bad in ("yes", 1, None, [True]):
        with pytest.raises(SpecError, match=r"^tenants\.team\.share_files: expected a boolean, got "):
            parse_tenants({"team": {"api_keys": ["sk-1"], "share_files": bad}})


def test_the_batch_lines_label_is_not_a_tenant_name():
    """The admission queue's depth names the batch lines waiting `tenant="batch"`: a tenant of that name
    would have its own depth overwritten, so the name is refused."""
    with pytest.raises(SpecError, match=r"^tenants\.batch: 'batch' is reserved"):
        parse_tenants({"batch": {"api_keys": ["sk-1"]}})
    assert "batch-jobs" in parse_tenants({"batch-jobs": {"api_keys": ["sk-1"]}})


def test_a_key_owns_what_it_creates_unless_its_tenant_shares_files():
    tenants = _make_tenants()
    assert tenants.owner("sk-s") == _key_owner("sk-s") and len(tenants.owner("sk-s")) == 4 + 64
    assert tenants.owner("sk-p1") != tenants.owner("sk-p2")              # one tenant, two owners
    assert tenants.resolve("sk-p1") == tenants.resolve("sk-p2") == "pair"
    assert tenants.owner("sk-t1") == tenants.owner("sk-t2") == "tenant:team"
    assert tenants.owner("sk-other-1") != tenants.owner("sk-other-2")    # unlisted keys: tenant default, not shared
    assert tenants.resolve("sk-other-1") == DEFAULT_TENANT
    assert tenants.owner(None) == tenants.owner("") == DEFAULT_OWNER == "default"
    assert all("sk-" not in tenants.owner(key) for key in ("sk-s", "sk-p1", "sk-t1", "sk-other-1"))
    assert Tenants().owner("sk-x") == _key_owner("sk-x") and Tenants().resolve("sk-x") == _key_owner("sk-x")[:12]
    sharing_default = Tenants(parse_tenants({"default": {"share_files": True}}))
    assert sharing_default.owner("sk-any") == sharing_default.owner("sk-else") == "tenant:default"
    assert sharing_default.owner(None) == DEFAULT_OWNER


def test_what_a_tenant_created_before_owners_goes_to_whoever_the_config_still_names():
    tenants = _make_tenants()
    per_key = "key-" + hashlib.sha256(b"sk-x").hexdigest()[:8]             # a tenant of `resolve` without tenants:
    assert tenants.legacy_owner("team") == "tenant:team"                  # shared: still shared
    assert tenants.legacy_owner("solo") == tenants.owner("sk-s")          # its one key
    assert tenants.legacy_owner(DEFAULT_TENANT) == DEFAULT_OWNER
    assert tenants.legacy_owner(per_key, api_keys=["sk-y", "sk-x"]) == tenants.owner("sk-x")
    assert tenants.legacy_owner(per_key) == f"tenant:{per_key}"           # that key is no longer configured
    assert tenants.legacy_owner("pair") == "tenant:pair"                  # two keys: reached once it shares
    assert tenants.legacy_owner("nightly") == "tenant:nightly" and tenants.legacy_owner("gone") == "tenant:gone"
    moved = Tenants(parse_tenants({"team": {"api_keys": ["sk-x", "sk-z"], "share_files": True}}))
    assert moved.legacy_owner(per_key, api_keys=["sk-x"]) == "tenant:team"   # its key now shares with a tenant
