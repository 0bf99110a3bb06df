"""The HTTP API's routes: one FastAPI router a module, by what its URLs are about.

``jobs`` (jobs, manifests, fleet status, tokens, audit), ``workers`` (the fleet and the
worker protocol), ``blobs`` (blobs and upload sessions), ``environments`` (environment
locks), ``sharing`` (usage), ``events`` (event streams), ``hooks`` (webhooks),
``metrics`` (``/metrics``) and ``dashboard`` (the web dashboard and sign-in).
:func:`gpufleet.server.app.create_app` includes every router.

Routes check who may call them, parse and answer; the work is done by the services
(:mod:`gpufleet.server.services`). Routes call services, never the store (an
import-linter contract in ``pyproject.toml``).
"""

from gpufleet.server.routes import (
    blobs,
    dashboard,
    environments,
    events,
    hooks,
    jobs,
    metrics,
    sharing,
    workers,
)

__all__ = [
    "blobs",
    "dashboard",
    "environments",
    "events",
    "hooks",
    "jobs",
    "metrics",
    "sharing",
    "workers",
]
