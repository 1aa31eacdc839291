"""Planning, pure data and functions: a composed config -> a validated `Plan` (processes, chips,
ports, environment, commands), its scaled and Kubernetes variants, the TPU chip-split table.
Imports nothing else of the launcher."""
