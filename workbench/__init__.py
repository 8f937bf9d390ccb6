"""K3 Workbench: probes, recorders, trace store, analysis and the `workbench` command line.

The engine (`engine`) runs the model; this package observes it and never the other way round.
"""
