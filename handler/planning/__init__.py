"""Planning each step: the cost table (`cost_table`, measured at start-up by `measure`), the
estimates learnt while serving (`estimators`), and the planner that prices the batch's choices
(`planner`)."""
