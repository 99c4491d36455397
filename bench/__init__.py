"""Benchmarks behind `cliffguard bench NAME`: each the module or package `bench/NAME` (bench/README.md).
Imported only by the CLI; this package's import loads nothing."""
