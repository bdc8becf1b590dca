"""The `tenants`, `admin_tokens` and `token_generation` tables: who may call the ledger, by token digest."""

from __future__ import annotations

from typing import NamedTuple

from accounting.ledger.databases import Connection, Database
from accounting.ledger.store.clock import now
from accounting.ledger.verification import StoredAdminToken, StoredTenant, stored_token_digest


class TenantRow(NamedTuple):
    """A row of `tenants`: its token's key id and hash (a salt only for a token still stored by scrypt)."""

    name: str
    key_id: str | None
    token_salt: bytes | None
    token_hash: bytes | None


_TENANT_COLUMNS = "name, key_id, token_salt, token_hash"


class Tenants:
    """The rows of the tenant and token tables in `database`; each method works on the connection it is given."""

    def __init__(self, database: Database) -> None:
        self._database = database

    @staticmethod
    def exists(connection: Connection, name: str) -> bool:
        """Whether tenant `name` exists."""
        return connection.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone() is not None

    @staticmethod
    def named(connection: Connection, name: str) -> TenantRow | None:
        """Tenant `name`, or None."""
        row = connection.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE name = ?", (name,)).fetchone()
        return TenantRow(*row) if row is not None else None

    @staticmethod
    def by_key_id(connection: Connection, key_id: str) -> TenantRow | None:
        """The tenant whose token has `key_id`, or None."""
        row = connection.execute(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE key_id = ?", (key_id,)).fetchone()
        return TenantRow(*row) if row is not None else None

    def insert(self, connection: Connection, name: str, key_id: str, token_hash: bytes) -> bool:
        """Add a tenant with a token stored by digest; False when one of that name exists."""
        try:
            connection.execute(
                "INSERT INTO tenants (name, key_id, token_salt, token_hash, created_at) VALUES (?, ?, ?, ?, ?)",
                (name, key_id, None, token_hash, now()),
            )
        except self._database.duplicate_errors:
            return False
        return True

    @staticmethod
    def insert_tokenless(connection: Connection, name: str) -> bool:
        """Add a tenant without a token unless it exists; whether it was added."""
        return bool(connection.execute(
            "INSERT INTO tenants (name, created_at) VALUES (?, ?) ON CONFLICT DO NOTHING", (name, now())
        ).rowcount)

    @staticmethod
    def store_digest(connection: Connection, key_id: str, salt: bytes, digest: bytes) -> None:
        """Store a token checked by scrypt by its digest instead (unless another request did it already)."""
        connection.execute(
            "UPDATE tenants SET token_salt = NULL, token_hash = ? WHERE key_id = ? AND token_salt = ?",
            (digest, key_id, salt),
        )

    @staticmethod
    def set_token(connection: Connection, name: str, key_id: str | None, digest: bytes | None) -> None:
        """Give a tenant the token of `key_id` and `digest` (None and None: no token)."""
        connection.execute(
            "UPDATE tenants SET key_id = ?, token_salt = NULL, token_hash = ? WHERE name = ?", (key_id, digest, name)
        )

    @staticmethod
    def every(connection: Connection) -> list[StoredTenant]:
        """Every tenant, by name, as `verify` replays it against its history."""
        return [
            StoredTenant(row.name, row.key_id, stored_token_digest(row.token_salt, row.token_hash))
            for row in (
                TenantRow(*row) for row in connection.execute(
                    f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name"
                ).fetchall()
            )
        ]

    @staticmethod
    def admin_token_digest(connection: Connection, key_id: str) -> bytes | None:
        """The digest of the admin token of `key_id`, None when there is none or it was revoked."""
        row = connection.execute(
            "SELECT token_hash FROM admin_tokens WHERE key_id = ? AND revoked_at IS NULL", (key_id,)
        ).fetchone()
        return row[0] if row is not None else None

    @staticmethod
    def add_admin_token(connection: Connection, key_id: str, digest: bytes, unless_known: bool = False) -> bool:
        """Keep an admin token by its digest; `unless_known`: leave a token of that key id as it is (revoked too).
        Whether it was added."""
        return bool(connection.execute(
            "INSERT INTO admin_tokens (key_id, token_hash, created_at) VALUES (?, ?, ?)"
            + (" ON CONFLICT DO NOTHING" if unless_known else ""),
            (key_id, digest, now()),
        ).rowcount)

    @staticmethod
    def every_admin_token(connection: Connection) -> list[StoredAdminToken]:
        """Every admin token, revoked or not, by key id, as `verify` replays it against its history."""
        return [
            StoredAdminToken(key_id, stored_token_digest(None, token_hash), revoked_at is not None)
            for key_id, token_hash, revoked_at in connection.execute(
                "SELECT key_id, token_hash, revoked_at FROM admin_tokens ORDER BY key_id"
            ).fetchall()
        ]

    @staticmethod
    def revoke_admin_token(connection: Connection, key_id: str) -> None:
        """Revoke the admin token of `key_id` now (one revoked already keeps its time)."""
        connection.execute(
            "UPDATE admin_tokens SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL", (now(), key_id)
        )

    @staticmethod
    def live_admin_key_ids(connection: Connection) -> list[str]:
        """The key ids of the admin tokens not revoked, sorted."""
        return [key_id for (key_id,) in connection.execute(
            "SELECT key_id FROM admin_tokens WHERE revoked_at IS NULL ORDER BY key_id"
        ).fetchall()]

    @staticmethod
    def live_tokens(connection: Connection) -> tuple[list[TenantRow], list[tuple[str, bytes]]]:
        """Every token that can authenticate: the tenants that hold one, and the (key id, digest) of each admin
        token not revoked."""
        tenants = [TenantRow(*row) for row in connection.execute(
            f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE key_id IS NOT NULL"
        ).fetchall()]
        admins = [(key_id, bytes(digest)) for key_id, digest in connection.execute(
            "SELECT key_id, token_hash FROM admin_tokens WHERE revoked_at IS NULL"
        ).fetchall()]
        return tenants, admins

    @staticmethod
    def generation(connection: Connection) -> int:
        """How many token changes (creations, rotations, revocations) the ledger has seen."""
        (generation,) = connection.execute("SELECT generation FROM token_generation").fetchone()
        return generation

    @staticmethod
    def count_token_change(connection: Connection) -> None:
        """One more token change."""
        connection.execute("UPDATE token_generation SET generation = generation + 1")
