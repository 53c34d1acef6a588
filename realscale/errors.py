"""Errors a user causes and can fix, as opposed to bugs.

:class:`UserError` is the base of every such error: a bad config, key or override
(:class:`realscale.config.ConfigError`), a bad command line (``UsageError``), a model
directory or dataset that is not there (:class:`realscale.models.tiny.ModelNotFoundError`,
:class:`realscale.data.dataset.DatasetError`), a recipe for hardware this machine lacks
(:class:`realscale.parallel.device.BackendError`, :class:`realscale.planner.hardware.HardwareError`),
a plan that cannot be placed (:class:`realscale.parallel.mesh.LayoutError`), a simulation or
workload that cannot be set up (:class:`realscale.sim.des.SimError`,
:class:`realscale.sim.workload.WorkloadError`), a source ``realscale data convert`` cannot
read (:class:`realscale.data.convert.ConvertError`). The
``realscale`` command prints one as a single line, ``realscale: error: ...``, and exits
with status 2; anything else is a bug and keeps its traceback. The message names what was
wrong and what to do. It subclasses ValueError, so code that caught the specific errors as
ValueError before still does. No imports here: ``realscale --help`` imports this module.
"""


class UserError(ValueError):
    """A mistake the user can fix; ``str()`` is one line naming what to do."""


class LaunchError(RuntimeError):
    """A process of the run failed or never became ready."""
