"""PD disaggregation: KVPoll, the 4-tuple ABC, the JAX transfer engine, side channel, mixins."""
