"""KV resharding between P and D instances laid out differently (tp, processes, chips).

layout.py (pure: KV head layouts and the plan of pieces, both sides compute the same one) <-
arrays.py (JAX: cutting, pulling and joining the pieces). The transport's manager drives them
(transport/resharding.py); nothing here imports the rest of disagg.
"""
