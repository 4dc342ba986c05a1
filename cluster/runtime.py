"""What runs inside every replica process: its identity (node, replica) and its heap trimming.
The launcher that starts Ray and deploys the application is `cluster.serve`; keeping the two apart
leaves no import cycle between the application (`app`, `verifier`) and its launcher.
"""
from __future__ import annotations

import time

HEAP_TRIM_S = 10.0
_heap_trim_started = False


def start_heap_trim(period_s: float = HEAP_TRIM_S) -> None:
    """Every `period_s`, hand the heap's free pages back to the OS (glibc `malloc_trim`; a no-op
    where the C library has none). Tensors of many sizes come and go between steps, and glibc keeps
    what they freed inside its arenas, so without this a replica's RSS wanders by a few hundred MB
    with the load rather than with what it holds. Once per process (later calls do nothing)."""
    import ctypes
    import threading

    global _heap_trim_started
    if _heap_trim_started:
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    _heap_trim_started = True

    def loop() -> None:
        while True:
            time.sleep(period_s)
            trim(0)

    threading.Thread(target=loop, name="specd-heap-trim", daemon=True).start()


def node_id() -> str:
    """The Ray node this process runs on ("local" outside Ray). Asks Ray only when this process is
    connected: `get_runtime_context` would otherwise start or join a cluster (a stale one: a hang)."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    except Exception:
        return "local"


def replica_id() -> str:
    """This Serve replica's id ("local" outside Serve, e.g. in unit tests)."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_tag
    except Exception:
        return "local"
