"""The serving engine, one process's worth: requests in, tokens out, over a paged KV pool.

request.py (Req, sampling params, sinks) -> scheduler.py (the decisions: batching, preemption;
the extension points the P/D mixins override), beside the state it works on: admission.py (the
inbox and the waiting queue), kv_pages.py (pages and the prefix cache), batch.py (a step's
rows), outputs.py (tokens out), stats.py (counters, the snapshot), step_errors.py and
overlap.py -> model_runner.py (weights, KV pool, one jitted forward per step) over
step_inputs.py (the closed set of step shapes) and attention.py (paged attention;
attention_fallback.py: the gather path when Mosaic refuses the TPU kernel);
sampling.py, page_allocator.py, metrics.py and mesh.py serve them. Nothing here knows about
disaggregation, local mode, HTTP or multi-process instances.
"""
