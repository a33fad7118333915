"""evaluation: held-out figures computed as every stage computes them: the gold judge on generations
(gold.py), reward-model pair metrics (pairs.py), perplexity (perplexity.py). Imports modeling/ and below."""
