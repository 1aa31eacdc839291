"""Operating a live deployment: the pre-flight, launch and render jobs, supervisord control,
health, status/stop/logs, drain/restart, scale, top, k8s jobs, the router's admin API and the
terminal display. Imports plan/ and render/; only `pdtopo.cli` imports `operate.launch`."""
