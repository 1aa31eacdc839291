"""Rendering: a `Plan` -> the files a deployment runs from (supervisord.conf, Kubernetes
objects, Prometheus and Grafana files, the run directory) and the config diff of two plans.
Imports plan/ only."""
