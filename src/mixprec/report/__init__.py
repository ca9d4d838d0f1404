"""The reproduction report, from the jobs' records (summary.json, metrics.jsonl; never W&B):

    load.py           the summary.json files under the inputs, as Jobs
    published.py      the published numbers (src/mixprec/published/*.yaml), checked
    analyse.py        groups, statistics, published-vs-reproduced verdicts, the sweep and ladder
    rows render.py         the report as Markdown/HTML, and the console tables (end of a job, end of
    a sweep) plots.py          its figures; probe_plots.py: the numerics probe's figures
    reference.py      scripts/reproduce.py's results folders side by side
    wandb_report.py   the same report as a W&B Report
    make.py           make_report: load -> analyse -> plots -> render -> files
    callbacks.py      the Hydra callback that prints a sweep's table (and makes its report)

Nothing is imported here, so `mixprec.report.render` (the end-of-job block) does not load
matplotlib.
"""
