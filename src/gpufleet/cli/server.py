"""``gpufleet server``: run the server with its settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from gpufleet.cli._common import DAY, retention_seconds, setting_option
from gpufleet.cli._flags import SettingFlags
from gpufleet.errors import ConfigError


def register(app: typer.Typer) -> None:
    app.command()(server)


@dataclass(frozen=True)
class ServerFlags(SettingFlags):
    """The options of ``gpufleet server``: each a setting of the same name."""

    host: Annotated[str | None, setting_option("host")] = None
    port: Annotated[int | None, setting_option("port")] = None
    data_dir: Annotated[Path | None, setting_option("data_dir")] = None
    db: Annotated[str | None, setting_option("db", extra=", e.g. postgresql://user@host/db")] = None
    lease_timeout: Annotated[float | None, setting_option("lease_timeout")] = None
    prefer_cuda_grace: Annotated[float | None, setting_option("prefer_cuda_grace")] = None
    retry_backoff: Annotated[float | None, setting_option("retry_backoff")] = None
    max_losses: Annotated[int | None, setting_option("max_losses")] = None
    checkpoint_keep: Annotated[int | None, setting_option("checkpoint_keep")] = None
    sharing: Annotated[Path | None, setting_option("sharing")] = None
    ephemeral_ttl: Annotated[float | None, setting_option("ephemeral_ttl")] = None
    log_retention: Annotated[float | None, setting_option("log_retention")] = None
    audit_retention: Annotated[float | None, setting_option("audit_retention")] = None
    output_quota: Annotated[str | None, setting_option("output_quota")] = None
    output_rate: Annotated[str | None, setting_option("output_rate")] = None
    output_burst: Annotated[str | None, setting_option("output_burst")] = None
    max_blob_size: Annotated[str | None, setting_option("max_blob_size")] = None
    blob_store: Annotated[str | None, setting_option("blob_store")] = None
    s3_endpoint: Annotated[str | None, setting_option("s3_endpoint")] = None
    tls_cert: Annotated[Path | None, setting_option("tls_cert")] = None
    tls_key: Annotated[Path | None, setting_option("tls_key")] = None
    access_log: Annotated[bool | None, setting_option("access_log")] = None
    metrics_public: Annotated[bool | None, setting_option("metrics_public")] = None
    api_docs: Annotated[bool | None, setting_option("api_docs")] = None
    trusted_proxies: Annotated[str | None, setting_option("trusted_proxies")] = None
    webhook_allow: Annotated[str | None, setting_option("webhook_allow")] = None


@ServerFlags.command
def server(**given: Any) -> None:
    """Run the server (queue, fleet state, API) until SIGINT or SIGTERM."""
    from gpufleet.domain.quota import OutputQuota
    from gpufleet.server import QueueSettings, ServerOptions, serve
    from gpufleet.server.limits import Limits
    from gpufleet.server.sharing import rules_file

    s = ServerFlags(**given).resolved()
    queue = QueueSettings(
        lease_timeout=s["lease_timeout"],
        prefer_cuda_grace=s["prefer_cuda_grace"],
        retry_backoff=s["retry_backoff"],
        max_losses=s["max_losses"],
        checkpoint_keep=s["checkpoint_keep"],
        sharing_file=rules_file(s["sharing"], s["data_dir"]),
        ephemeral_ttl=s["ephemeral_ttl"],
        log_retention=retention_seconds(s["log_retention"], DAY),
        audit_retention=retention_seconds(s["audit_retention"], DAY),
        output_quota=OutputQuota(s["output_quota"], s["output_rate"], s["output_burst"]),
        webhook_allow=webhook_allow(s["webhook_allow"]),
        host=s["host"],
    )
    serve(
        ServerOptions(
            host=s["host"],
            port=s["port"],
            data_dir=s["data_dir"],
            db=s["db"],
            queue=queue,
            max_blob_size=s["max_blob_size"],
            blob_store=s["blob_store"],
            s3_endpoint=s["s3_endpoint"],
            tls_cert=s["tls_cert"],
            tls_key=s["tls_key"],
            access_log=s["access_log"],
            metrics_public=s["metrics_public"],
            api_docs=s["api_docs"],
            limits=Limits(trusted_proxies=proxies(s["trusted_proxies"])),
        )
    )


def proxies(given: str | None) -> tuple[str, ...]:
    """``--trusted-proxies`` as addresses and networks; a bad one is named."""
    import ipaddress

    found = tuple(p.strip() for p in (given or "").split(",") if p.strip())
    for entry in found:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ConfigError(
                f"--trusted-proxies: {entry!r} is not an address or network (such as "
                "127.0.0.1 or 10.0.0.0/8)"
            ) from None
    return found


def webhook_allow(given: str | None) -> tuple[str, ...]:
    """``--webhook-allow`` as host names, addresses and networks; a bad one is named."""
    from gpufleet.domain.destinations import Allowed

    found = tuple(p.strip() for p in (given or "").split(",") if p.strip())
    try:
        Allowed.of(found)
    except ValueError as exc:
        raise ConfigError(f"--webhook-allow: {exc}") from None
    return found
