"""Serving benchmarks and sweeps: workload -> load generator -> statistics -> report / summary.

`pdtopo bench [URL]` runs `run.run_bench` against a live server or proxy; in `pdtopo launch -m`
every Hydra job runs it against its own deployment (`job.bench_job`) and `sweep.SweepSummary`
writes the cross-job comparison at the end of the sweep.
"""
