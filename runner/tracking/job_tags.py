"""Tags a job's MLflow run carries so that tools outside the job read its results without
knowing the stages (runner/engine/job.py writes them; runner/tracking/sweep.py, report and publish
read them).

- `comparison.columns`: the row of the sweep comparison, from each stage's `Stage.columns`;
- `comparison.objective`: the column of the stage that declares the run's objective;
- `comparison.plotted`: the columns a comparison plots, the objective's first;
- `comparison.series`: settings that make a plot's series rather than its x axis;
- `comparison.floors`: {column: [value, label]}, a plotted column's value of a draft that does
  nothing, drawn as a line on the sweep's figure;
- `results.json` (an artifact): the stages' `Stage.results` rows (e.g. acceptance per set).
"""

COLUMNS_TAG = "comparison.columns"
OBJECTIVE_TAG = "comparison.objective"
PLOTTED_TAG = "comparison.plotted"
SERIES_TAG = "comparison.series"
FLOORS_TAG = "comparison.floors"
RESULTS_FILE = "results.json"
