"""The steps of a scheduling cycle, one module each, each a function of (plan, context).

    expire -> settle -> handover -> unhealthy -> walk -> consolidate -> reclaim -> grow -> explain -> idle

`policy/cycle.py` lists them in order, each gated by the config.
"""
