"""Job states, Ray's and ours, in one enum (no imports: the CLI, storage and the API share it)."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """A job's state. Ray's five, plus STOPPING: ours, a stop was asked for and Ray has not
    finished it. A ``str``: ``JobStatus.RUNNING == "RUNNING"``."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES

    @classmethod
    def from_ray(cls, value: object) -> JobStatus:
        """Ray's status (its enum or its name) as ours; a state this build does not know reads
        RUNNING, never terminal, so the job is followed until Ray says one we know."""
        name = str(getattr(value, "value", value))
        try:
            return cls(name)
        except ValueError:
            return cls.RUNNING


TERMINAL_STATUSES = frozenset({JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED})
