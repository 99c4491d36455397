"""The configuration: the YAML pool file read (`yaml_file`: `load_config`) into frozen, validated dataclasses
(`spec`: pools, routes, the whole config; `device_spec`: devices, replicas, placement; `gateway_spec`: the
`gateway` section), with the hand-written checks every key goes through (`checks`: errors name the key path)."""
