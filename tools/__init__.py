"""What sits on top of the service: the `elevator` command (cli.py, top.py),
the demo (demo.py, tfds_example.py), a launcher for `elevator serve` child
processes (launcher.py), the benchmarks (bench/) and the converters
(convert/). Workers import nothing from here: what a config names lives in
`grain_elevator.pipelines`."""
