"""What runs on every rank of a job, with torch and submitit only: the models, their
parallelisation (FSDP2 or DDP), the timed training step, what a run measures (collectives,
memory, timing, MFU), the parity check, the rendezvous and the worker that ties them up.

Nothing is imported here: the driver imports `spec` (what a job is given) without torch."""
