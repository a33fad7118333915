"""modeling: loading models and tokenizers (load.py), the Hugging Face export (export.py), roles (roles.py:
Policy, ValueModel) and the forward passes through them (forward.py). Imports core/, config/, data/, algos/."""
