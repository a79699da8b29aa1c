"""hetserve's daemon: HTTP API, engine loop, scheduler and the backends it drives."""
