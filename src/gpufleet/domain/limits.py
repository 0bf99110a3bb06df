"""The limits a manifest's values keep (the API keeps the same)."""

SCHEMA_VERSION = 1
MAX_NAME = 200
MAX_ARG = 100_000
MAX_PRIORITY = 1_000_000
MAX_GIB = 1_000_000
MAX_GPUS = 64
MAX_ATTEMPTS = 100
MAX_TIMEOUT = 10_000_000
