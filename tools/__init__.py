"""What sits on top of the service: the `elevator` command, the demos, a
launcher for `elevator serve` child processes, the benchmarks and the
converters (docs/design.md, "pipelines/ and tools/", says which module does what). Workers
import nothing from here: what a config names lives in
`grain_elevator.pipelines`."""
