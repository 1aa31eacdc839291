"""pdtopo: declarative prefill/decode disaggregated LLM serving on JAX.

The launcher (pdtopo.launcher) turns a composed Hydra config into a plan of processes and runs
them under supervisord; every P/D process runs pdtopo.runtime parameterised from that same config.
"""

__version__ = "0.1.0"
