"""The central marginal baselines the table benchmarks compare fedsyn with: MST and AIM on one
site's or the pooled records (``benchmarks/tables.py``). Not part of the fedsyn packages."""
