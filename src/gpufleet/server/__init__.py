"""The gpufleet server: queue, fleet state, and the HTTP API."""

from gpufleet.server.app import create_app
from gpufleet.server.serve import ServerOptions, serve
from gpufleet.server.services import Services
from gpufleet.server.settings import QueueSettings

__all__ = ["QueueSettings", "ServerOptions", "Services", "create_app", "serve"]
