"""The connector's configuration error, in a module of its own: the config parser and the helpers it calls (secret
files, second-tier options) all raise it, and none of them needs the other to do so."""


class ConfigError(ValueError):
    """A `kv_connector_extra_config` value the connector cannot run with."""
