"""The run's configuration: the dataclasses and their checks (schema), YAML files and `section.key=value`
overrides (yaml_file), and the documented ranges of the numeric keys (ranges)."""
