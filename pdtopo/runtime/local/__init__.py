"""Local (in-process) PD disaggregation: tpu-inference's single-host mode (docs/protocol.md#modes).

One server process owns every chip of the host and splits them into one or more prefill meshes
and one or more decode meshes, each with its own `ModelRunner` and KV pool:

    HTTP -> LocalOrchestrator.submit -> prefill engine thread(s)      (prefill.py)
         -> transfer backlog (bounded) -> transfer thread             (transfer.py)
            jax.device_put of the packed pages onto a decode mesh
         -> decode backlog of the least loaded decode engine (bounded, sized from its pool)
         -> decode engine thread: insert_kv_chunks, continuous decoding (decode.py)

Modules: `slices` (parse `topology.prefill_slices` / `decode_slices`; pure, also used by the
launcher), `threads` (crash-fails-the-process worker threads, fault injection), `board`
(request registry and decode load, the only state shared across threads), `metrics_view`
(per-engine gauges summed into the process's Prometheus gauges), `orchestrator` (queues,
threads, the scheduler-like facade the HTTP app drives), `engine` (assembly from the config).
This package's `__init__` imports nothing heavy: the launcher imports `slices`.
"""
