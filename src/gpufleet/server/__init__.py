"""The gpufleet server: queue, fleet state, and the HTTP API."""

from gpufleet.wire._base import build_all

# The wire models build their validators lazily (for the CLI's start); the routes' own
# validators are made as the route modules are imported, from the built models.
build_all()

from gpufleet.server.app import create_app  # noqa: E402
from gpufleet.server.serve import ServerOptions, serve  # noqa: E402
from gpufleet.server.services import Services  # noqa: E402
from gpufleet.server.settings import QueueSettings  # noqa: E402

__all__ = ["QueueSettings", "ServerOptions", "Services", "create_app", "serve"]
