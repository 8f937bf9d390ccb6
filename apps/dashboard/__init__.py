"""The live K3 Workbench dashboard (Panel): the registered views over a trace directory, followed live.

- `apps.dashboard.app.create_app(config)`: the whole dashboard for one browser session (or a notebook).
- `apps.dashboard.app.serve(config)`: run the Panel server (what `workbench dashboard` does).
- `apps.dashboard.follower`: the follower thread, the bounded queue and the state the views watch.
- `apps.dashboard.session_runner`: drive mode (run a model session, recorded, from the browser).
- `apps.dashboard.task_form`: drive mode's task templates (questions a trained model was trained to answer).
- `apps.dashboard.views`: the one registry of views (name, reducer, component, options).
The views' data is computed by pure reducers in `workbench.analysis.views`.
"""
