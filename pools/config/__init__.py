"""The configuration: the YAML pool file read (`yaml_file`: `load_config`) into frozen msgspec models, one per
section (`spec`: pools, routes, the whole config; `device_spec`: devices, replicas, placement; `gateway_spec`:
the `gateway` section), on the base and the error type of `checks` (errors name the key path), with `typed`
turning msgspec's messages into field paths and plain words."""
