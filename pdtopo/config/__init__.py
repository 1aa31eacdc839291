"""Config access: locating conf/, composing it with Hydra, typed schema."""

# Registers the typed topology/proxy schemas in Hydra's ConfigStore (conf/topology/*.yaml
# extend `/pdtopo_topology_schema`), so any composition through this package sees them.
from pdtopo.config import schema as _schema  # noqa: E402,F401
