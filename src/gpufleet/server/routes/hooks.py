"""Webhooks: word when a job ends (:mod:`gpufleet.server.hooks`). A webhook's URL and
secret are taken here once and never answered again."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response

from gpufleet.server import deps
from gpufleet.server.access import Caller
from gpufleet.server.deps import note, state
from gpufleet.server.hooks import view
from gpufleet.wire import ERRORS, WebhookCreate, WebhookCreated, WebhookOut

router = APIRouter(prefix="/v1", responses=ERRORS, tags=["webhooks"])
Reader = Annotated[Caller, Depends(deps.reader)]
HookId = Annotated[str, Path(max_length=64, description="the webhook's id (h-...)")]


@router.post("/webhooks", response_model=WebhookCreated, status_code=201)
def create_webhook(body: WebhookCreate, request: Request, caller: Reader) -> WebhookCreated:
    """Set a webhook: for the caller's own jobs, a pool's (operators and admins) or one
    job's. The URL is checked against the server's allowed destinations (422 naming
    ``url``). The answer shows the URL's host only, and the secret only when the server
    made it (this once)."""
    hook, made = state(request).services.webhooks.create(caller, body)
    note(request, hook.id)
    return view(hook, made)


@router.get("/webhooks", response_model=list[WebhookOut])
def list_webhooks(request: Request, caller: Reader) -> list[WebhookOut]:
    """The webhooks the caller set (an admin: all; an operator: also its pools'): their
    ids, events, scope and the URL's host; never the URL or the secret."""
    hooks = state(request).services.webhooks.visible(caller)
    return [WebhookOut(**view(h).model_dump(exclude={"secret"})) for h in hooks]


@router.delete("/webhooks/{hook_id}", status_code=204)
def remove_webhook(hook_id: HookId, request: Request, caller: Reader) -> Response:
    """Remove a webhook the caller sees; deliveries still due are dropped."""
    state(request).services.webhooks.remove(caller, hook_id)
    note(request, hook_id)
    return Response(status_code=204)
