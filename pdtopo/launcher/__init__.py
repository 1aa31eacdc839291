"""Launcher: composed config -> plan -> rendered files -> a live deployment under supervisord.

Four sub-packages, each importing only those before it: plan/ (pure: config -> Plan),
render/ (pure: Plan -> files), operate/ (a live deployment: supervisord, HTTP, scale, restart,
top, k8s jobs) and programs/ (what supervisord runs with `python -m`). `hydra_app` runs a verb
as a Hydra app.
"""
