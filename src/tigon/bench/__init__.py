"""The benchmark harness behind ``tigon bench``: one spec per op, run on a GPU, results to JSON,
markdown and PNG. Shipped inside the package so that ``tigon bench`` works wherever tigon is
installed; ``benchmarks/`` at the repository root keeps the results and the end-to-end benchmark.
"""
