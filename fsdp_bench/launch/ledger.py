"""Which runs went into which job, on disk (`jobs/ledger.json`): a driver killed and started
again finds the jobs it submitted and follows them instead of submitting them twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdp_bench.store import now_iso, write_atomic


class Ledger:
    """Which runs went into which job, on disk, so a restarted driver can find its jobs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []

    def add(self, kind: str, jobs: list[tuple[str, list[str]]]) -> None:
        """Jobs just submitted: (job id, run ids) each."""
        submitted_at = now_iso()
        self.entries += [
            {"job_id": job_id, "launcher": kind, "run_ids": run_ids,
             "submitted_at": submitted_at, "open": True}
            for job_id, run_ids in jobs
        ]  # fmt: skip
        self._save()

    def close(self, job_id: str) -> None:
        for entry in self.entries:
            if entry["job_id"] == job_id:
                entry["open"] = False
        self._save()

    def open_jobs(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["open"] and e["launcher"] == kind]

    def _save(self) -> None:
        write_atomic(self.path, json.dumps(self.entries, indent=1))
