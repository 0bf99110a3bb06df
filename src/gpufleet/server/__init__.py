"""The gpufleet server: queue, fleet state, and the HTTP API."""

from gpufleet.server.app import create_app
from gpufleet.server.queue import QueueService
from gpufleet.server.serve import ServerOptions, serve
from gpufleet.server.settings import QueueSettings

__all__ = ["QueueService", "QueueSettings", "ServerOptions", "create_app", "serve"]
