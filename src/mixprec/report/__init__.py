"""The reproduction report, from the jobs' records (summary.json, metrics.jsonl; never W&B):

    load.py           the summary.json files under the inputs, as Jobs
    published.py      the published numbers (src/mixprec/published/*.yaml), checked
    analyse.py        groups, statistics, published-vs-reproduced verdicts, sweep and ladder rows
    rows.py           the cells the console's tables and the report share (rows, ladder, notes)
    console.py        what the console prints: the end-of-job block, a sweep's tables
    render.py         the report as Markdown/HTML, one function per section
    plots.py          its figures, one function per figure
    probe_plots.py    the numerics probe's figures (layer heatmap, histograms)
    reference.py      scripts/reproduce.py's results folders side by side
    readme.py         docs/results.md from those folders
    wandb_report.py   the same report as a W&B Report
    make.py           make_report: load -> analyse -> plots -> render -> files
    callbacks.py      the Hydra callback that prints a sweep's table (and makes its report)

Nothing is imported here, so `mixprec.report.console` (the end-of-job block) does not load
matplotlib.
"""
