"""Signal families: one module per family (`dsa`, `kda`, `moe`) holding what it means end to end.

Each module declares its trace tables, what the recorder asks its probe points for, how emissions
become rows on the device, and its readers' accessors, and registers itself (`family.register`).
The recorder, the trace writer and the reader loop over `registered()` and name no family.

Adding a family: declare its `Signal` in `engine.probes` and emit it from its layer; write one
module here that builds a `SignalFamily` and registers it (import it below to ship it).
"""

from workbench.signals.family import (RecordingContext, families_from_spec, RunningSums, SignalFamily, register, registered,
                                      unregister)
from workbench.signals import dsa, kda, moe  # noqa: E402,F401  (registration)
from workbench.signals import integrity  # noqa: E402  (the health tables ride on the three families)

integrity.install()

__all__ = ["families_from_spec", "RecordingContext", "RunningSums", "SignalFamily", "register", "registered", "unregister"]
