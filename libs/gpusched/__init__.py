"""gpusched: an event-sourced GPU cluster scheduler."""
