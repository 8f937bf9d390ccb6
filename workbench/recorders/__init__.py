"""Recorders: probe sinks that reduce engine signals into trace rows (`record`, `RecordPolicy`)."""

from workbench.record.policy import ALL, RecordPolicy, load_policy
from workbench.record.recorder import Recorder, record

__all__ = ["ALL", "RecordPolicy", "Recorder", "load_policy", "record"]
