"""Step-time simulation of whole RL runs (issue 19).

- :mod:`realscale.sim.workload`: answer lengths and group acceptance;
- :mod:`realscale.sim.des`: the discrete-event simulator (servers, controller, trainer);
- :mod:`realscale.sim.build`: a simulation from a recipe, a plan or a published layout, with
  step times from the planner's cost model (:mod:`realscale.planner.cost`) and a hardware
  profile (:mod:`realscale.planner.hardware`; CPU profiles measured by
  :mod:`realscale.launcher.calibrate`);
- :mod:`realscale.sim.transfer`: the weight-sync and batch-path terms (link model or
  assumed, or measured: the resharder's and the batch scatter's benchmark results);
- :mod:`realscale.sim.recipe`: a scenario from a recipe (and a plan);
- :mod:`realscale.sim.paper`: the AReaL paper's published figures, the calibration on the
  1.5B ones, and the held-out predictions;
- :mod:`realscale.sim.validate`: predictions of our own measured CPU runs.
"""
