"""The gpufleet Python SDK."""

from gpufleet.client._api import Call
from gpufleet.client._client import AsyncClient, Client
from gpufleet.client._events import Event
from gpufleet.client.webhooks import verify_webhook

__all__ = ["AsyncClient", "Call", "Client", "Event", "verify_webhook"]
