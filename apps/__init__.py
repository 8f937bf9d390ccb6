"""Applications built on the workbench's public API (the Panel dashboard lives in `apps.dashboard`)."""
