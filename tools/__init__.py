"""Tools around the service, which no serving process imports: the `elevator`
command's front end (cli.py), the demo, an example record format with its
pipelines (examples.py), a launcher for `elevator serve` child processes, and
the benchmarks (bench/)."""
