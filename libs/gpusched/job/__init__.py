"""The job SDK: `ctx = gpusched.job.context()` gives `job_id`, `attempt`, `resume_from`,
`checkpoint_requested` and `ctx.checkpoint(path_or_obj, step)`. Works outside gpusched too."""

from .context import JobContext, context, load_checkpoint, write_durably

__all__ = ["JobContext", "context", "load_checkpoint", "write_durably"]
