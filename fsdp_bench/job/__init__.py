"""What runs on every rank of a job, with torch and submitit only. Here: the worker that ties a
job up, what it is given (`spec`), the rendezvous, the training step, the parity check, the
watchdog, failures and the record. Below: `model` (what is trained), `parallel` (how it is
parallelised) and `measure` (what a run measures).

Nothing is imported here: the driver imports `spec` (what a job is given) without torch."""
