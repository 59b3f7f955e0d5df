"""The web dashboard service (`gpusched service run dashboard`, started by `gpusched up`)."""

from .app import Dashboard, add_arguments, make_app, run, serve

__all__ = ["Dashboard", "add_arguments", "make_app", "run", "serve"]
