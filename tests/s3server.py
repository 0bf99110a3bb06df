"""A real S3-protocol server on loopback for the tests: moto's server mode (``moto_server``,
from the dev extra), one process per test session, a fresh bucket per test. Its
credentials are dummies: moto checks signatures' form, not who signed."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from tests.procs import Proc, free_port, wait_for

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "gpufleet-test",
    "AWS_SECRET_ACCESS_KEY": "gpufleet-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "moto_server"
        argv = [str(exe), "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = Proc(argv, {"PATH": "/usr/bin:/bin", **CREDENTIALS}, log)
        self.client = self._client()
        wait_for(self._up, 30, "moto_server to answer")

    def _client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def _up(self) -> bool:
        if self.proc.popen.poll() is not None:
            raise AssertionError(f"moto_server exited:\n{self.proc.text()[-2000:]}")
        try:
            self.client.list_buckets()
        except Exception:  # not listening yet
            return False
        return True

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        name = "gpufleet-" + secrets.token_hex(6)
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found = self.client.list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for o in found.get("Contents", []))

    def unfinished(self, bucket: str) -> list[str]:
        """Keys with a multipart upload in progress."""
        found = self.client.list_multipart_uploads(Bucket=bucket)
        return sorted(u["Key"] for u in found.get("Uploads", []))

    def stop(self) -> None:
        self.proc.stop()
