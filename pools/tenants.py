"""Tenants: who a request belongs to, what share of a pool's queue and which priorities it may use, and
who owns the files and batches it creates.

A tenant is named by its API key. The YAML's optional `tenants:` section lists them:

    tenants:
      search:  {api_keys: [sk-search-1], weight: 3}            # 3 turns for every 1 of a weight-1 tenant
      nightly: {api_keys: [sk-nightly], min_priority: 10}      # may never ask for better than priority 10
      team:    {api_keys: [sk-t1, sk-t2], share_files: true}   # its keys see each other's files and batches
      default: {weight: 1}                                      # unlisted keys and requests with no key

Without the section every API key is a tenant of its own (named `key-` + the first 8 hex digits of
its SHA-256, so keys never reach metric labels) and requests without a key share `default`. With it,
a listed key maps to its tenant and anything else to `default`: new keys cannot buy new shares. Keys
listed here are accepted API keys too (the gateway then requires a key on /v1/...).

`weight` and `min_priority` become the credit ledger's `TenantPolicy` (`pools.credits.ledger`): within a
tenant a smaller priority is served first, and a body's `priority` better than `min_priority` is
clamped to it.

Owners (`Tenants.owner`, the one rule): a file or batch of the Batch API belongs to the API key that
created it, named `key-` + the full SHA-256 hex of the key (never the key itself); a request without a
key is owner `default`. A tenant groups keys for fairness only: its keys share files and batches only
when its YAML says `share_files: true` (default false), and then they belong to `tenant:<name>`. The
three forms cannot collide. `Tenants.legacy_owner` maps what a tenant created before owners existed
(batch store schema 2 and older) to one of these owners.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec

from pools.credits.ledger import DEFAULT_TENANT, TenantPolicy
from pools.config.checks import Spec, SpecError, Text, from_yaml, is_label

_PER_KEY_TENANT = re.compile(r"key-[0-9a-f]{8}")                # `resolve` without a tenants: section (whole)
DEFAULT_OWNER = DEFAULT_TENANT                                  # owner of requests without a key


class TenantSpec(Spec):
    """One entry of the YAML's `tenants:` section (`name`: its key there)."""

    NOT_IN_YAML = ("name",)

    name: str
    api_keys: tuple[Text, ...] = ()
    weight: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1   # share of the queue, relative to the others
    min_priority: int = 0            # the best (smallest) priority its requests may ask for
    share_files: bool = False        # its keys own files and batches together (`tenant:<name>`)

    @property
    def policy(self) -> TenantPolicy:
        return TenantPolicy(weight=self.weight, min_priority=self.min_priority)


class Tenants:
    """Resolves an API key to a tenant name and to the owner of what it creates; holds each tenant's policy."""

    def __init__(self, specs: Mapping[str, TenantSpec] | None = None) -> None:
        self.specs = dict(specs or {})
        self._by_key = {key: spec.name for spec in self.specs.values() for key in spec.api_keys}

    @property
    def policies(self) -> dict[str, TenantPolicy]:
        return {name: spec.policy for name, spec in self.specs.items()}

    def policy(self, tenant: str) -> TenantPolicy:
        """`tenant`'s weight and min_priority (an unlisted tenant: the defaults)."""
        spec = self.specs.get(tenant)
        return spec.policy if spec is not None else TenantPolicy()

    def resolve(self, api_key: str | None) -> str:
        """The tenant of a request sent with `api_key` (None: no key)."""
        if api_key:
            if api_key in self._by_key:
                return self._by_key[api_key]
            if not self.specs:
                return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:8]
        return DEFAULT_TENANT

    def owner(self, api_key: str | None) -> str:
        """Who owns the files and batches a request sent with `api_key` creates, and so which ones it
        may see: `key-<sha256 hex of the key>`, `tenant:<name>` when the key's tenant has
        `share_files: true`, or `default` for a request without a key."""
        if not api_key:
            return DEFAULT_OWNER
        spec = self.specs.get(self.resolve(api_key))
        if spec is not None and spec.share_files:
            return f"tenant:{spec.name}"
        return "key-" + hashlib.sha256(api_key.encode()).hexdigest()

    def legacy_owner(self, tenant: str, api_keys: Iterable[str] = ()) -> str:
        """The owner, under this configuration, of what `tenant` created when files belonged to tenants
        (batch store schema 2 and older): whoever can still be told apart as its creator.

        A tenant with `share_files: true` -> `tenant:<name>`; `default` -> `default` (requests without a
        key); a listed tenant with one key -> that key's owner; a per-key tenant `key-<8 hex>` -> the
        owner of the one key among `api_keys` and the listed keys whose SHA-256 starts so; anything
        else (a tenant of several keys, a key no longer configured) -> `tenant:<name>`, which its keys
        reach once the tenant is given `share_files: true`."""
        spec = self.specs.get(tenant)
        if spec is not None and spec.share_files:
            return f"tenant:{tenant}"
        if tenant == DEFAULT_TENANT:
            return DEFAULT_OWNER
        if spec is not None and len(spec.api_keys) == 1:
            return self.owner(spec.api_keys[0])
        if spec is None and _PER_KEY_TENANT.fullmatch(tenant):
            keys = {key for key in (*api_keys, *self._by_key)
                    if hashlib.sha256(key.encode()).hexdigest()[:8] == tenant[4:]}
            if len(keys) == 1:
                return self.owner(keys.pop())
        return f"tenant:{tenant}"


BATCH_LABEL = "batch"   # the tenant label of the batch lines waiting for credits (`gateway.admission`)


def parse_tenants(raw: Any) -> dict[str, TenantSpec]:
    """The YAML's `tenants:` mapping -> {name: TenantSpec}; SpecError naming `tenants.<name>.<key>`."""
    specs = from_yaml({} if raw is None else raw, dict[str, Any], "tenants")
    owner: dict[str, str] = {}
    for name, value in specs.items():
        key = f"tenants.{name}"
        if not is_label(name):   # metric labels
            raise SpecError(key, f"a tenant name uses letters, digits, '_', '.', '-', got {name!r}")
        if name == BATCH_LABEL:
            raise SpecError(key, f"{name!r} is reserved: the admission queue's metrics name the batch lines "
                                 "waiting so (tenant=\"batch\"); choose another name")
        spec = from_yaml({} if value is None else value, TenantSpec, key, name=name)
        api_keys = tuple(k.strip() for k in spec.api_keys)
        for i, api_key in enumerate(api_keys):
            if not api_key:
                raise SpecError(f"{key}.api_keys[{i}]", f"an API key must not be blank, got {spec.api_keys[i]!r}")
            if api_key in owner:
                raise SpecError(f"{key}.api_keys", f"a key is listed for tenants {owner[api_key]!r} and {name!r}; "
                                                   "each key belongs to one tenant")
            owner[api_key] = name
        specs[name] = spec.replace(api_keys=api_keys)
    return specs
