"""The foundations every other room stands on, importing none of them: the run's settings
(`settings`: one value, resolved once, bound for a run), the error tree (`errors`), a
setting's value read from text (`values`), the device (`device`), a gate's typed verdict
(`records`), the gate vocabulary (`kinds`: which items are gates, their markers) and a gate's
reports (`gate_reports`), the one builder of every child pytest and its private channels
(`child`), the commands' shared checks (`usage`), and small helpers (`interrupt`, `gitref`,
`project_modules`, `forkserver_main`: the fork server's process, run as a script)."""
