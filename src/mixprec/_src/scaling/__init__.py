"""Dynamic loss scaling: settings, the update rule, the iteration protocol and the GradScaler."""
