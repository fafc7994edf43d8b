"""Planning each step, one module a role:

- `cost_table` (measured at start-up by `measure`): what a pass costs;
- `trackers`: the counters learnt while serving (acceptance, calibrations, the outcome check);
- `acceptance`: from them, what each proposal is expected to give (E(0..n) curves), and what a
  verified one teaches them;
- `pricing`: pure functions that price a batch's choices with curves and costs;
- `planner`: the step's plan, one `RowPlan` per row (its drafter, k and tree), and the
  `Drafts` a row verifies once the draft loop has run.
"""
