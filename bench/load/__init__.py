"""The open-loop load generator behind `cliffguard bench serve` (bench/serve.py, the command) and the
benchmarks that drive a live server: `plan` (the run's configuration, arrivals, prompts), `sender`
(one request sent and measured), `scrape` (`/metrics` while it runs), `report` (percentiles, goodput,
files, the table), `run` (`run_load`: plan to report)."""
