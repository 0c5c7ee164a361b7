"""The class of a failure from its words: an exception's message on a rank, a line of a rank's
log read by the driver. Without torch, as the driver imports it."""

from __future__ import annotations

# Out-of-memory as the allocators and libraries word it when they do not raise
# torch.OutOfMemoryError: the CPU allocator ("can't allocate memory"), a CUDA runtime error
# surfaced by a kernel ("CUDA error: out of memory"), NCCL failing to allocate its buffers
# ("unhandled cuda error ... Cuda failure 'out of memory'"), cuBLAS failing to allocate its
# workspace (CUBLAS_STATUS_ALLOC_FAILED).
_OOM_SIGNS = (
    "can't allocate memory",
    "out of memory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
)
_TIMEOUT_SIGNS = ("timed out", "timeout")
_PEER_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "econnreset",
)


def classify_text(text: str) -> str:
    """The class of a failure from its words (an exception's, or a log line's)."""
    lowered = text.lower()
    if any(sign in lowered for sign in _OOM_SIGNS):
        return "oom"
    if any(sign in lowered for sign in _TIMEOUT_SIGNS):
        return "timeout"
    if any(sign in lowered for sign in _PEER_SIGNS):
        return "peer"
    return "error"
