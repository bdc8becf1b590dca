"""Who is asking: a request's caller, the ledger's own actors, and which dataset a caller's name means."""

from __future__ import annotations

from dataclasses import dataclass

from accounting.ledger.errors import InvalidArgument, PermissionDenied
from accounting.ledger.validation import check_name

ADMIN_ACTOR = "admin"
LOCAL_TENANT = "local"


@dataclass(frozen=True)
class Caller:
    """Who makes a request: `actor` is written to the history; `tenant` owns bare dataset names.

    An admin sees and changes every tenant's datasets; a tenant only its own.
    """

    actor: str
    tenant: str | None
    admin: bool = False
    # The key id of the token the caller authenticated with (None: no token, as the embedded ledger's admin).
    key_id: str | None = None


def tenant_caller(tenant: str) -> Caller:
    """A tenant acting on its own datasets."""
    return Caller(actor=tenant, tenant=tenant)


ADMIN = Caller(actor=ADMIN_ACTOR, tenant=None, admin=True)
# Who releases a reservation whose lease ran out, in the history.
LEASE_EXPIRY = Caller(actor="ledger (lease expired)", tenant=None, admin=True)
# Who admits a queued job, and who takes one out of the queue at its deadline, in the history.
QUEUE_ADMISSION = Caller(actor="ledger (queue)", tenant=None, admin=True)
QUEUE_TIMEOUT = Caller(actor="ledger (queue deadline)", tenant=None, admin=True)


@dataclass(frozen=True)
class DatasetRef:
    """A dataset's full name: the tenant that owns it and its name within that tenant."""

    tenant: str
    name: str


def no_access(reference: str) -> PermissionDenied:
    """The one error for a dataset that is someone else's or does not exist (existence is never revealed)."""
    return PermissionDenied(
        f"no dataset {reference!r} that this token may use; a tenant sees only its own datasets "
        "(dpfleet ledger status lists them)"
    )


def no_reservation(reservation_id: str) -> PermissionDenied:
    """The one error for a reservation that is someone else's or does not exist."""
    return PermissionDenied(
        f"no reservation {reservation_id!r} that this token may use (dpfleet ledger jobs lists yours)"
    )


def resolve_dataset(caller: Caller, reference: object, shared: bool = False) -> DatasetRef:
    """The dataset a caller means by `reference`: 'name' in its own tenant, or 'tenant/name'.

    A tenant naming another tenant's dataset gets PermissionDenied, unless
    `shared`: then the store lets it through only where the tenant holds a
    quota there. An admin with no tenant of its own must write 'tenant/name'.
    """
    if not isinstance(reference, str):
        raise InvalidArgument(f"dataset must be a name (got {reference!r})")
    tenant, slash, name = reference.rpartition("/")
    if slash:
        check_name("tenant name", tenant)
    check_name("dataset name", name)
    if not slash:
        if caller.tenant is None:
            raise InvalidArgument(
                f"the admin owns no datasets; name a tenant's dataset as TENANT/NAME (got {reference!r})"
            )
        tenant = caller.tenant
    if not caller.admin and tenant != caller.tenant and not shared:
        raise no_access(reference)
    return DatasetRef(tenant, name)


def display_name(caller: Caller, dataset: DatasetRef) -> str:
    """A dataset's name as the caller writes it: bare in its own tenant, 'tenant/name' otherwise."""
    return dataset.name if dataset.tenant == caller.tenant else f"{dataset.tenant}/{dataset.name}"
