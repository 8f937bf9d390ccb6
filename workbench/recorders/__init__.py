"""Recorders: probe sinks that reduce engine signals into trace rows (`record`, `RecordPolicy`)."""

from workbench.recorders.policy import ALL, RecordPolicy, load_policy
from workbench.recorders.recorder import Recorder, record

__all__ = ["ALL", "RecordPolicy", "Recorder", "load_policy", "record"]
