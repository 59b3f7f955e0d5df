"""The multi-host lab: each NATS server (and, as it grows, each service group and node agent)
on its own network host, a Linux network namespace on a bridge, faults as nft drops
(`netns`), running the deployed configuration (`cluster`)."""
