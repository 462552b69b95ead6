"""Benchmarks of the system around the engine: submit and export, the HTTP API, many workers and the store,
kill -9 soaks."""
