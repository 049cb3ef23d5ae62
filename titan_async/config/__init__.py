"""The run config: the TOML file and `--set` overrides read into one `RunConfig` of sections
(`run_config`, with field parsing and suggestions in `fields`), checked against the world size,
and assembled into torchtitan's trainer config (`assemble`)."""
