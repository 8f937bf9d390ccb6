"""Recorders: probe sinks that turn engine signals into trace rows through their families (`record`, `RecordPolicy`)."""

from workbench.recorders.policy import ALL, RecordPolicy, load_policy
from workbench.recorders.recorder import Recorder, record

__all__ = ["ALL", "RecordPolicy", "Recorder", "load_policy", "record"]
