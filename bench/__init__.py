"""The benchmarks, by topic: kernels/, engine/, system/, decisions/, with shared helpers in lib/.

Run a script from the repository root (`python bench/<topic>/<script>.py --help`); each puts the root on sys.path
so that `bench`, `tests` and (with PYTHONPATH naming a folder that holds an `omlx_jobs` link) the package import.
Figures are in bench/RESULTS.md, raw output in bench/results/<topic>/.
"""
