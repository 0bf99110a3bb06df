"""Who is calling, and what that caller may see and touch.

A route's role check (in :mod:`gpufleet.server.deps`) says which calls a token may make at
all; the ``Caller`` here answers the object-level questions: is this job's or worker's pool
one of the token's pools, is this worker enrolled with this token. Objects the caller may
not see are answered as if they did not exist (404), so ids cannot be probed.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.domain.models import Role
from gpufleet.errors import Forbidden, NotFound, ValidationFailed
from gpufleet.store import TokenRow

DEFAULT_POOL = "default"


@dataclass(frozen=True)
class Caller:
    token: TokenRow

    @property
    def id(self) -> str:
        return self.token.id

    @property
    def name(self) -> str:
        """The token's name: who did it, in a job's event log."""
        return self.token.name

    @property
    def role(self) -> Role:
        return Role(self.token.role)

    @property
    def pools(self) -> tuple[str, ...] | None:
        """The pools this caller is confined to; None: every pool (admin, an operator of
        every pool). A submitter or worker token without pools (none should exist) gets
        ``default``."""
        if self.role == Role.ADMIN or (self.role == Role.OPERATOR and not self.token.pools):
            return None
        return self.token.pools or (DEFAULT_POOL,)

    @property
    def owner(self) -> str | None:
        """The token whose jobs alone this caller may steer (cancel, stop, requeue): a
        submitter's own; None for an operator or admin (any job they see)."""
        return self.id if self.role == Role.SUBMITTER else None

    def sees(self, pool: str) -> bool:
        return self.pools is None or pool in self.pools

    def may_use(self, pool: str) -> None:
        """Forbidden unless the caller may put work into (or run work of) ``pool``."""
        if not self.sees(pool):
            assert self.pools is not None
            raise Forbidden(
                f"this {self.role.value} token is scoped to pool "
                f"{', '.join(repr(p) for p in self.pools)}, not {pool!r}",
                detail={"pool": pool, "allowed": list(self.pools)},
            )

    def default_pool(self) -> str:
        """The pool a submit without one goes to: ``default``, or the token's only pool."""
        if self.pools is None or DEFAULT_POOL in self.pools:
            return DEFAULT_POOL
        if len(self.pools) == 1:
            return self.pools[0]
        raise ValidationFailed(
            f"this token may use pools {', '.join(self.pools)}: say which (pool, or --pool)",
            detail={"field": "pool"},
        )

    def visible(self, pool: str, what: str, ref: str) -> None:
        """NotFound (as for an unknown id) unless ``pool`` is one the caller sees."""
        if not self.sees(pool):
            raise NotFound(f"no {what} {ref!r}", detail={what: ref})


def check_pools(role: Role, pools: list[str]) -> list[str]:
    """The pools a new token of ``role`` gets, or ValidationFailed naming the rule broken.
    An operator token without pools acts on every pool; with pools, on those only."""
    if role == Role.ADMIN:
        if pools:
            raise ValidationFailed(
                "an admin token sees every pool; pools apply to operator, submitter and "
                "worker tokens",
                detail={"field": "pools"},
            )
        return []
    if role == Role.OPERATOR:
        return list(dict.fromkeys(pools))
    pools = list(dict.fromkeys(pools)) or [DEFAULT_POOL]
    if role == Role.WORKER and len(pools) != 1:
        raise ValidationFailed(
            "a worker token belongs to exactly one pool", detail={"field": "pools"}
        )
    return pools
