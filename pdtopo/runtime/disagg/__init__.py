"""PD disaggregation: the P and D roles of a scheduler, over a KV transport.

The roles, here: prefill.py and decode.py (the scheduler mixins P and D run), mixin_base.py
(what both share: the KV manager, the bootstrap registration), held_budget.py (P's bound on held
KV copies) and observability.py (the PD metrics and D's per-request timeline).

    prefill.py / decode.py --> transport/ (KVPoll, the 4 abstract roles and the JAX manager,
                               sender and receiver over the transfer engine and the side channel)
                           --> reshard/   (KV head layouts, the pieces between two of them)

transport/ never imports the roles; reshard/ imports nothing of disagg but transport/
(tests/unit/test_import_graph.py).
"""
