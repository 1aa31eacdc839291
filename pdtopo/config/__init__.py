"""Config access: locating conf/, composing it with Hydra, typed schema."""
