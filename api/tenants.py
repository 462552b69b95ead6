"""API keys as tenants: each key sees the files and batches it created, an admin key sees every one.

An object records the id of the key that created it: a hash, never the key (`key_id`). A key that did not
create an object gets a 404 for it, as if it were absent; lists hold only its own objects. Objects made by a
server without keys, or before keys were tenants (owner NULL), are visible to every key. The Guard
(api/auth.py) puts the request's Tenant in the ASGI scope; routes read it with `tenant_of`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

SCOPE_KEY = "omlx_tenant"


def key_id(key: str) -> str:
    """What the store keeps of a key: a salted SHA-256, cut to 128 bits (enough to tell keys apart, and the key
    cannot be read back from it)."""
    return "key_" + hashlib.sha256(b"omlx-jobs api key\0" + key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Tenant:
    """Who is asking: the id of their key (None on a server without keys) and whether it is an admin key."""

    key_id: str | None = None
    admin: bool = False

    @property
    def owner(self) -> str | None:
        """What objects created by this request record as their owner."""
        return self.key_id

    @property
    def scope(self) -> str | None:
        """The owner to filter lists by; None means every object (an admin key, or a server without keys)."""
        return None if self.admin or self.key_id is None else self.key_id

    def sees(self, owner: str | None) -> bool:
        """Whether an object recorded with `owner` exists for this tenant."""
        return self.scope is None or owner is None or owner == self.scope


EVERYONE = Tenant()
"""A server without keys: one tenant, who sees everything (and only loopback reaches it)."""


def tenant_of(request: Any) -> Tenant:
    """The Tenant the Guard found for this request."""
    return request.scope.get("state", {}).get(SCOPE_KEY, EVERYONE)  # type: ignore[no-any-return]
