"""core: errors, hub access, the embedded task, paths, user-callable loading. Imports nothing from rlhf."""
