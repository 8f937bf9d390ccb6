"""The live K3 Workbench dashboard (Panel): four views over a trace directory, followed live.

- `apps.dashboard.app.create_app(config)`: the whole dashboard for one browser session (or a notebook).
- `apps.dashboard.app.serve(config)`: run the Panel server (what `workbench dashboard` does).
- `apps.dashboard.state`: the follower thread, the bounded queue and the state the views watch.
- `apps.dashboard.session_runner`: drive mode (run a model session, recorded, from the browser).
- `apps.dashboard.replay.TraceReplay`: replays a finished trace as if it were being recorded (tests, demos).
"""
